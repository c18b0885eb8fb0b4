"""kvtier inside the real scheduler of vLLM releases that serve only on a GPU (0.33, 0.34), its
worker half over the KV cache those releases allocate, on the CPU (``vllm_loop``): lookups,
loads (with "ask again"), stores, preemption, aborts, a finished request's delayed free, sleep
mode, load errors, and 0.34's ``may_load_async`` and ``requires_kv_delivery``. Every token that
vLLM counts as computed without this loop computing it is checked byte for byte, and every run
ends with vLLM's scheduler and kvtier both holding nothing. Run by
``scripts/check_vllm_releases.sh`` in each release's environment."""

import glob
import os
import random

import pytest

from vllm_loop import Loop, model_dir

pytestmark = pytest.mark.releases

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("model") / "model")


def config(tmp_path, **extra):
    return {"disk_dir": str(tmp_path / "disk"), "host_bytes": "2MiB", **extra}


def release() -> tuple[int, ...]:
    from kvtier.integrations.vllm.compat import vllm_release
    return tuple(int(part) for part in vllm_release().split(".")[:2])


@pytest.mark.parametrize("layout, extra", [("LBNHC", {}), ("LBHNC", {}), ("BLNHC", {}), ("LHBNC", {}),
                                           ("LBNHC", {"layerwise": True}), ("LBNHC", {"in_step_load_bytes": 0})])
def test_a_prompt_is_loaded_from_kvtier_byte_exact_in_every_kv_cache_layout(model, tmp_path, layout, extra):
    loop = Loop(model, config(tmp_path, **extra), layout=layout)
    loop.add("a", PROMPT)
    loop.run()
    assert loop.checked_tokens == 0 and loop.outputs["a"]
    assert loop.scheduler.reset_prefix_cache()  # the next hit can only come from kvtier
    loop.add("b", PROMPT + [7, 8, 9])
    loop.run()
    assert loop.checked_tokens == 96  # six blocks loaded, each token's KV checked in every layer
    assert loop.side().hits.tokens["host"] == 96 and loop.outputs["b"]
    # A host hit is copied within the step of its forward (vLLM's synchronous load: the answer's
    # second half False), unless in_step_load_bytes is below its size.
    assert loop.answers[-1] == (96, extra.get("in_step_load_bytes") == 0)
    loop.assert_nothing_held()
    loop.close()


def test_a_new_engine_loads_from_disk_and_its_lookups_of_a_shared_directory_ask_again(model, tmp_path):
    shared = f"file://{tmp_path}/shared"
    first = Loop(model, config(tmp_path, remote_url=shared))
    first.add("a", PROMPT)
    first.run()
    first.close()
    for extra, tier in (({}, "disk"), ({"disk_dir": None}, "file")):
        loop = Loop(model, config(tmp_path, remote_url=shared, **extra))
        loop.add("b", PROMPT + [5])
        loop.run()
        assert loop.checked_tokens == 96 and loop.side().hits.tokens[tier] == 96
        if tier == "file":  # its existence checks go off the scheduler's thread: vLLM asks again
            assert loop.answers[0] == (None, False) and (96, True) in loop.answers
        loop.assert_nothing_held()
        loop.close()


@pytest.mark.parametrize("in_step", [True, False])
def test_preemptions_and_random_aborts_leave_nothing_held_and_every_loaded_token_exact(model, tmp_path, in_step):
    rng = random.Random(7)
    # 20 device blocks for four requests of up to 8 each: vLLM preempts; host slots for 12 blocks.
    extra = {} if in_step else {"in_step_load_bytes": 0}
    loop = Loop(model, config(tmp_path, host_bytes=12 * 8192, **extra), num_blocks=20, max_num_seqs=4,
                max_num_batched_tokens=48)
    prefixes = [list(range(2000 + 100 * p, 2000 + 100 * p + 64)) for p in range(3)]
    preempted = 0
    added = aborted = 0
    for round_ in range(6):
        for i in range(4):
            prompt = rng.choice(prefixes) + [rng.randrange(30000) for _ in range(rng.randrange(1, 40))]
            loop.add(f"r{round_}-{i}", prompt, max_tokens=rng.randrange(1, 150 - len(prompt)))
            added += 1
        for _ in range(rng.randrange(5, 40)):
            output_before = loop.steps
            loop.step()
            preempted += len(loop.last_output.preempted_req_ids or ())
            running = [r for r in loop.scheduler.requests if r.startswith(f"r{round_}")]
            if running and rng.random() < 0.08:
                loop.abort(rng.choice(running))
                aborted += 1
            assert loop.steps == output_before + 1
    loop.run()
    assert preempted > 0 and aborted > 0 and loop.checked_tokens > 0
    loop.assert_nothing_held()
    # A request that ends in the step that computes its prompt: that step's store still reads its
    # blocks (vLLM frees a finished request before it reads the step's reports), so vLLM keeps them
    # until the store is reported. Whether the random requests above hit this is left to timing.
    stats = loop.side().manager.stats
    delayed, stored = loop.delayed_frees, stats.stored_blocks
    loop.add("last", list(range(9000, 9000 + 2 * loop.block_size)), max_tokens=1)
    loop.run()
    assert loop.delayed_frees == delayed + 1 and stats.stored_blocks == stored + 2
    loop.assert_nothing_held()
    loop.close()


def test_sleep_mode_keeps_the_tiers_and_loads_into_the_cache_mapped_again(model, tmp_path):
    loop = Loop(model, config(tmp_path))
    loop.add("a", PROMPT)
    loop.run()
    loop.worker_connector.unregister_kv_caches()  # what vLLM's worker does before the cache is released
    for cache in loop.caches.values():
        cache.zero_()  # its content is gone
    loop.scheduler.reset_prefix_cache()
    loop.worker_connector.restore_kv_caches()
    loop.add("b", PROMPT + [1])
    loop.run()
    assert loop.checked_tokens == 96
    loop.assert_nothing_held()
    loop.close()


def test_damaged_entries_are_load_errors_that_vllm_recomputes(model, tmp_path):
    first = Loop(model, config(tmp_path))
    first.add("a", PROMPT)
    first.run()
    first.close()
    entry_bytes = 64 + 2 * 2 * 16 * 64 * 2  # a header and one block of both layers
    for path in glob.glob(str(tmp_path / "disk" / "**" / "entries-*.kvtier"), recursive=True):
        with open(path, "r+b") as file:
            for place in range(7):  # the store wrote its 7 blocks at the file's first places
                file.seek(place * entry_bytes + entry_bytes - 1)  # each entry's last payload byte
                byte = file.read(1)
                file.seek(-1, os.SEEK_CUR)
                file.write(bytes([byte[0] ^ 0xFF]))
    loop = Loop(model, config(tmp_path))
    loop.add("b", PROMPT + [1])
    loop.run()
    assert loop.invalid_block_ids == {1, 2, 3, 4, 5, 6}  # vLLM heard (get_block_ids_with_load_errors)
    assert loop.side().hits.tokens["disk"] == 0 and loop.outputs["b"]
    loop.assert_nothing_held()
    loop.close()


def test_requires_kv_delivery_is_a_producers_alone(model, tmp_path):
    for role, expected in (("kv_both", False), ("kv_producer", True)):
        loop = Loop(model, config(tmp_path / role, remote_url=f"file://{tmp_path}/pool"), kv_role=role)
        assert loop.connector.requires_kv_delivery is expected
        if hasattr(loop.scheduler, "requires_kv_delivery"):
            assert loop.scheduler.requires_kv_delivery is expected  # what vLLM's scheduler took
        loop.close()


@pytest.mark.skipif(release() < (0, 34), reason="vLLM 0.34 adds may_load_async")
@pytest.mark.parametrize("inflight, in_step", [(None, False), (2, False), (2, True)])
def test_with_inflight_loads_a_hit_loads_while_the_batch_is_full(model, tmp_path, inflight, in_step):
    """A hit that loads beside the steps (here every hit, with in_step_load_bytes 0: as a disk hit
    does) loads while the batch is full; a host hit copied within its step waits for a free slot in
    the batch instead, and is scheduled, copied and computed in the step that frees it."""
    from vllm.v1.request import RequestStatus

    extra = {} if in_step else {"in_step_load_bytes": 0}
    loop = Loop(model, config(tmp_path, **extra), max_num_seqs=2, max_num_inflight_kv_loads=inflight)
    loop.add("a", PROMPT)
    loop.run()
    loop.scheduler.reset_prefix_cache()
    loop.add("x", list(range(5000, 5040)), max_tokens=30)
    loop.add("y", list(range(6000, 6040)), max_tokens=30)
    loop.run(until=lambda: len(loop.scheduler.running) == 2)
    request = loop.add("b", PROMPT + [3])
    assert loop.connector.may_load_async(request) and not loop.connector.may_load_async(
        loop.add("c", list(range(7000, 7040))))
    loaded_while_full = False
    while "b" not in loop.computed:
        loaded_while_full |= len(loop.scheduler.running) == 2 and request.status in (
            RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING) and request.num_computed_tokens >= 96
        loop.step()
    assert loaded_while_full == (inflight is not None and not in_step)
    assert (96, not in_step) in loop.answers and (96, in_step) not in loop.answers
    loop.run()
    assert loop.checked_tokens >= 96
    loop.assert_nothing_held()
    loop.close()


def test_this_release_starts_without_the_unchecked_release_warning(caplog, monkeypatch):
    from test_vllm_compat import check_installed_release_warning
    check_installed_release_warning(caplog, monkeypatch)
