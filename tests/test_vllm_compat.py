"""vLLM release differences: the static API check, the start-up checks, and sleep mode."""

import logging
import shutil
import time

import numpy as np
import pytest
import torch

from kvtier.integrations.vllm import api_check, compat

BASE = api_check.BASE


def test_the_installed_vllm_fits_kvtiers_connector():
    report = api_check.check(api_check.VllmSource(), api_check.VllmSource())
    assert report.breaks == [] and report.new_in_base == []
    assert {"build_connector_worker_meta", "update_connector_output", "start_load_kv"} <= set(report.called)


def test_a_release_that_would_break_the_connector_is_reported(tmp_path):
    installed = api_check.VllmSource()
    base = installed.read(BASE)
    base = base.replace("def build_connector_worker_meta(", "def build_connector_worker_metadata(")
    base = base.replace("def start_load_kv(self, forward_context", "def start_load_kv(self, context")
    base = base.replace("    def shutdown(self):", "    @abstractmethod\n    def prepare_sleep(self) -> None:\n"
                                               "        return None\n\n    def shutdown(self):")
    target = tmp_path / "vllm" / BASE.removeprefix("vllm/")
    target.parent.mkdir(parents=True)
    target.write_text(base)
    shutil.copy(installed._root / "vllm" / "_version.py", tmp_path / "vllm" / "_version.py")
    report = api_check.check(api_check.VllmSource(str(tmp_path)), installed)
    breaks = "\n".join(report.breaks)
    assert "`build_connector_worker_meta` is not a connector hook any more" in breaks
    assert "`start_load_kv`: vLLM's takes (self, context, **kwargs)" in breaks
    assert "`prepare_sleep` is abstract and kvtier does not implement it" in breaks
    assert "`vllm.v1.request` is gone" in breaks  # only base.py was kept
    assert any("prepare_sleep" in line for line in report.new_in_base)


def test_a_vllm_without_a_hook_kvtier_needs_stops_start_up_naming_it():
    hooks = {name: (lambda self: None) for name in api_check.REQUIRED if name != "build_connector_worker_meta"}
    base = type("OldBase", (), hooks)
    with pytest.raises(RuntimeError, match="lacks the connector hooks build_connector_worker_meta"):
        compat.check_vllm(base, release="0.99.0")


def test_a_vllm_older_than_the_oldest_supported_release_stops_start_up_naming_it():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    for release in ("0.29.1", "0.11.0", "0.30.0rc1"):
        with pytest.raises(RuntimeError, match=f"vLLM {release} is older than 0.30.0, the oldest release"):
            compat.check_vllm(KVConnectorBase_V1, release=release)
    compat.check_vllm(KVConnectorBase_V1, release="0.30.0")  # the oldest supported, and a source build's
    compat.check_vllm(KVConnectorBase_V1, release="unknown")  # version, start


def test_a_vllm_outside_the_tested_releases_gets_one_warning(caplog, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    monkeypatch.setattr(compat, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        compat.check_vllm(KVConnectorBase_V1, release="0.99.0")
        compat.check_vllm(KVConnectorBase_V1, release="0.99.0")
    warnings = [r.getMessage() for r in caplog.records if "not been checked" in r.getMessage()]
    assert warnings == ["kvtier: running on vLLM 0.99.0, which kvtier has not been checked with; it is tested end "
                        "to end with vLLM 0.30.0, 0.31.0, 0.32.0 and inside the scheduler of vLLM 0.33.0, 0.34.0"]
    caplog.clear()
    monkeypatch.setattr(compat, "_warned", False)
    compat.check_vllm(KVConnectorBase_V1, release=compat.TESTED_RELEASES[0])
    assert not caplog.records


def test_the_installed_vllm_warns_at_start_up_exactly_when_it_is_newer_than_the_last_release_checked(caplog,
                                                                                                    monkeypatch):
    check_installed_release_warning(caplog, monkeypatch)


def check_installed_release_warning(caplog, monkeypatch):
    """Fails on a vLLM newer than the last release checked unless its start-up warns, naming it."""
    from packaging.version import Version
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    release = compat.vllm_release()
    checked = compat.TESTED_RELEASES + compat.SCHEDULER_CHECKED_RELEASES
    monkeypatch.setattr(compat, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        compat.check_vllm(KVConnectorBase_V1)
    warned = [r.getMessage() for r in caplog.records if f"running on vLLM {release}, which" in r.getMessage()]
    assert bool(warned) == (release not in checked), (release, warned)
    if Version(release) > max(Version(r) for r in checked):
        assert warned


# --- sleep mode (vLLM 0.33): the KV cache is released and mapped again ---------------------

def test_sleep_mode_drains_refuses_copies_and_rebinds_to_the_remapped_cache(disk_dir):
    from test_tiering import NAMESPACE, NB, BS, Engine, keys_of, randomize

    from kvtier.integrations.vllm.namespace import EngineGeometry
    from kvtier.integrations.vllm.worker_side import WorkerSide

    tensors = [torch.zeros(NB, 4, BS, 2 * 24, dtype=torch.bfloat16) for _ in range(3)]
    engine = Engine(tensors, disk_dir, host_blocks=16)
    randomize(tensors)
    original = [t[1:5].clone() for t in tensors]
    engine.store(keys_of(range(4)), [1, 2, 3, 4])

    # The connector's hooks, as vLLM 0.33's worker calls them around sleep and wake-up.
    geometry = EngineGeometry(NAMESPACE, engine.worker.layout.slot_bytes, ["a", "b", "c"], NB, BS, 1, 1)
    side = WorkerSide(engine.config, geometry, 0)
    side.tier_worker = engine.worker
    hooks = type("Hooks", (compat.VllmCompat,), {})()
    hooks._worker_side = side
    assert compat.VllmCompat.supports_sleep_mode(None)

    hooks.unregister_kv_caches()
    hooks.unregister_kv_caches()  # idempotent
    assert engine.worker.transfers.suspended
    stale = [t.detach() for t in tensors]  # the old mapping
    for t in tensors:
        t.set_(torch.zeros_like(t))  # the cache comes back at another address
    for s in stale:
        s.zero_()
    job, report = engine.load(keys_of(range(4)), [10, 11, 12, 13])  # while asleep: no copy, recompute
    assert not report.success and sorted(report.failed_block_ids) == [10, 11, 12, 13]
    assert all(int(t.count_nonzero()) == 0 for t in tensors + stale)

    hooks.restore_kv_caches()
    hooks.restore_kv_caches()  # idempotent
    assert not engine.worker.transfers.suspended
    job, report = engine.load(keys_of(range(4)), [20, 21, 22, 23])  # the blocks were kept in host slots
    assert report.success
    for t, o in zip(tensors, original):
        assert torch.equal(t[20:24].view(torch.int16), o.view(torch.int16))  # the new mapping got them
    assert all(int(s.count_nonzero()) == 0 for s in stale)  # and nothing went to the old one
    engine.store(keys_of(range(50, 52)), [20, 21])  # stores read the new mapping
    assert engine.manager.host.num_pins == 0
    engine.close()


def test_suspending_waits_for_copies_in_flight_and_refuses_new_ones():
    from kvtier.common.layout import detect_layout
    from kvtier.transfer.cpu import CpuCopier
    from kvtier.transfer.engine import TransferEngine, TransferJob
    from kvtier.transfer.host_buffer import allocate_host_buffer
    from kvtier.worker import tensor_info

    tensors = [torch.ones(256, 4096, dtype=torch.uint8) for _ in range(8)]  # 8 MiB: copies take a moment
    layout = detect_layout([tensor_info(t) for t in tensors], 256, 16)
    host = allocate_host_buffer(256, layout.slot_bytes, pin=False)
    engine = TransferEngine(CpuCopier(layout, tensors, host, 1))
    running = [engine.submit(TransferJob(np.arange(256), np.arange(256), True)) for _ in range(4)]
    engine.suspend(timeout=30)
    assert engine.num_in_flight == 0  # every copy submitted before finished first
    results = {r.job_id: r for r in engine.poll()}
    assert all(results[j].success for j in running)
    refused = engine.submit(TransferJob(np.arange(4), np.arange(4), False))
    (result,) = engine.poll()
    assert result.job_id == refused and not result.success and "sleep mode" in result.error
    engine.resume(CpuCopier(layout, tensors, host, 1))
    slow = [engine.submit(TransferJob(np.arange(256), np.arange(256), True)) for _ in range(8)]
    with pytest.raises(RuntimeError, match="still running"):
        engine.suspend(timeout=0.0)  # the copies cannot have finished: refused, nothing changed
    assert not engine.suspended
    assert engine.wait(slow, timeout=60) and all(r.success for r in engine.poll())
    again = engine.submit(TransferJob(np.arange(4), np.arange(4), False))
    deadline = time.monotonic() + 10
    while engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    (result,) = engine.poll()
    assert result.job_id == again and result.success
    engine.close()


def test_kvtier_takes_full_attention_and_sliding_window_caches_and_names_the_others():
    """vLLM's own cache specs: full attention (with a sliding window noted: a mixed model's local layers
    without the hybrid cache manager), MLA and sliding-window blocks are taken, the last with the window
    past which vLLM frees them (none where it spans max_model_len); chunked local attention alone, and
    non-causal (prefix LM) attention, whose KV depends on later tokens, stop start-up naming why."""
    import torch
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)

    from kvtier.integrations.vllm.namespace import _check_every_token_kept, _frees_past

    shape = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    for taken, frees_past in ((FullAttentionSpec(**shape), 0), (FullAttentionSpec(**shape, sliding_window=96), 0),
                              (FullAttentionSpec(**shape, attention_chunk_size=64), 0),
                              (MLAAttentionSpec(**{**shape, "num_kv_heads": 1}), 0),
                              (SlidingWindowSpec(**shape, sliding_window=4096), 0),
                              (SlidingWindowSpec(**shape, sliding_window=4095), 4095)):
        _check_every_token_kept(taken)
        assert _frees_past(taken, max_model_len=4096) == frees_past
    if "extra_retained_tokens" in SlidingWindowSpec.__dataclass_fields__:  # vLLM 0.32: kept below the window
        assert _frees_past(SlidingWindowSpec(**shape, sliding_window=100, extra_retained_tokens=8), 4096) == 108
    for refused, words in ((ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
                           (FullAttentionSpec(**shape, non_causal=True), "non-causal")):
        with pytest.raises(ValueError, match=words):
            _check_every_token_kept(refused)


@pytest.mark.parametrize("window", [1, 17, 100, 4095])
def test_the_blocks_kvtier_takes_as_freed_are_those_vllms_sliding_window_frees(window):
    """kvtier's count of a request's leading blocks that vLLM frees (or pads with its null block) at n
    tokens computed is vLLM's own; of a hit, the first block vLLM reads is the first not freed."""
    from types import SimpleNamespace

    from test_tiering import NAMESPACE
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from kvtier.integrations.vllm.namespace import EngineGeometry

    geometry = EngineGeometry(NAMESPACE, 1, ["a"], 64, 32, 1, 1, sliding_window=window)
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    for n in range(0, 5000, 7):
        assert geometry.skipped_blocks(n) == SlidingWindowManager.get_num_skipped_tokens(manager, n) // 32
    start, num_full, num_tokens = 3, 28, 900  # blocks 3.. of a 900-token prompt, vLLM's cache covers 0..2
    first_read = geometry.first_read(start, num_full, num_tokens)
    for n in range(1, num_full - start + 2):  # the last: the partial block's hit, the whole prompt
        tokens = (start + n) * 32 if start + n <= num_full else num_tokens
        assert first_read(n) == max(0, SlidingWindowManager.get_num_skipped_tokens(manager, tokens) // 32 - start)
        assert first_read(n) <= n
    assert EngineGeometry(NAMESPACE, 1, ["a"], 64, 32, 1, 1).first_read(start, num_full, num_tokens) is None


def test_each_8_bit_kv_format_keys_blocks_of_its_own_and_fp8_is_e4m3(tmp_path):
    """vLLM keeps fp8 e4m3 and e5m2 KV alike in uint8 tensors of one shape; the namespace that vLLM's
    configuration gives (as the running connector's and ``kvtier doctor --model``'s) names the format.
    Engine-free, so that it runs where vLLM's CPU attention keeps no 8-bit KV (x86 without AVX-512 or
    AMX): the engine test of the same (``test_vllm_e2e``) needs one that does."""
    from kvtier.cli.demo.model import make_model
    from kvtier.common.config import KVTierConfig
    from kvtier.integrations.vllm.namespace import offline_namespace

    model = str(make_model(tmp_path / "model", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2))
    config = KVTierConfig.from_sources({}, environ={})

    def namespace(kv_cache_dtype):
        return offline_namespace(model, {"dtype": "bfloat16", "max_model_len": 2048, "block_size": 32,
                                         "kv_cache_dtype": kv_cache_dtype}, config)

    formats = {name: namespace(name) for name in ("auto", "fp8_e4m3", "fp8_e5m2", "fp8")}
    assert {name: ns.kv_dtype for name, ns in formats.items()} == {
        "auto": "torch.bfloat16", "fp8_e4m3": "torch.uint8:fp8_e4m3", "fp8_e5m2": "torch.uint8:fp8_e5m2",
        "fp8": "torch.uint8:fp8_e4m3"}
    assert formats["fp8"] == formats["fp8_e4m3"]
    assert len({formats[name] for name in ("auto", "fp8_e4m3", "fp8_e5m2")}) == 3
