"""vLLM's engine loop without a model: its real ``Scheduler``, its worker's connector driver
(``ActiveKVConnector``: the calls and their order in each step), and the KV cache its worker
allocates (``allocate_kv_cache``, in any of its physical layouts), on the CPU.

Only the forward is the loop's own: it writes each scheduled token's KV as a function of the
tokens up to it, and first checks that every token vLLM counts as computed before it (loaded by
kvtier, or found in vLLM's prefix cache) holds the bytes its own computation would have written.
The sampled token is a function of the prefix too, so two runs of one prompt agree. Used by
``test_vllm_releases.py`` in the environments of vLLM releases that need a GPU to serve
(``scripts/check_vllm_releases.sh``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket

import torch

LAYERS, HEADS, HEAD_SIZE = 2, 2, 32


def model_dir(path) -> str:
    from kvtier.cli.demo.model import make_model
    return str(make_model(path, num_layers=LAYERS, hidden_size=HEADS * 2 * HEAD_SIZE, num_heads=HEADS * 2,
                          num_kv_heads=HEADS))


def init_distributed() -> None:
    """vLLM's process groups for one worker, on gloo (once per process)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)


def value_of(tokens) -> int:
    return int.from_bytes(hashlib.blake2b(repr(list(tokens)).encode(), digest_size=8).digest(), "little")


class Loop:
    def __init__(self, model: str, extra: dict, layout: str = "LBNHC", num_blocks: int = 64, block_size: int = 16,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 64, kv_role: str = "kv_both",
                 max_num_inflight_kv_loads: int | None = None):
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                                 VllmConfig, set_current_vllm_config)
        from vllm.distributed.kv_transfer.kv_transfer_state import (ensure_kv_transfer_initialized,
                                                                    get_kv_transfer_group)
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
        from vllm.v1.worker.utils import allocate_kv_cache

        init_distributed()
        from vllm.distributed.kv_transfer import kv_transfer_state
        if kv_transfer_state._KV_CONNECTOR_AGENT is not None:  # a failed test's loop: closed, not reused
            kv_transfer_state._KV_CONNECTOR_AGENT.shutdown()
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        self.block_size = block_size
        max_model_len = (num_blocks - 1) * block_size // 2
        scheduler_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True)
        if max_num_inflight_kv_loads is not None:
            scheduler_args["max_num_inflight_kv_loads"] = max_num_inflight_kv_loads
        self.vllm_config = config = VllmConfig(
            model_config=ModelConfig(model=model, dtype="bfloat16", seed=0, max_model_len=max_model_len),
            scheduler_config=SchedulerConfig(**scheduler_args),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(kv_connector="KVTierConnector", kv_role=kv_role,
                                                kv_connector_module_path="kvtier.integrations.vllm",
                                                kv_connector_extra_config=extra),
            device_config=DeviceConfig("cpu"))
        specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS,
                                                                       head_size=HEAD_SIZE, dtype=torch.bfloat16)
                 for i in range(LAYERS)}
        page = next(iter(specs.values())).page_size_bytes
        config.cache_config.kv_cache_layout = layout  # the engine core resolves it before planning
        groups = get_global_kv_cache_groups(config, [specs])
        self.kv_cache_config = get_kv_cache_configs(config, [specs], [page * LAYERS * num_blocks], groups)[0]
        config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout])
        self.layers = list(specs)
        with set_current_vllm_config(config):
            self.scheduler = Scheduler(vllm_config=config, kv_cache_config=self.kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(config),
                                       block_size=block_size, log_stats=True)
            ensure_kv_transfer_initialized(config, self.kv_cache_config)  # the worker's connector
            self.worker = ActiveKVConnector(config, self.caches)
        self.worker_connector = get_kv_transfer_group()
        self.connector = self.scheduler.connector
        # vLLM's start-up handshake: every worker's metadata, to the scheduler's connector.
        self.connector.set_xfer_handshake_metadata({0: self.worker_connector.get_handshake_metadata()})
        self.computed: dict[str, int] = {}  # req_id -> tokens whose KV this loop wrote or checked
        self.outputs: dict[str, list[int]] = {}
        self.checked_tokens = 0  # tokens counted as computed that the loop did not compute, each checked
        self.invalid_block_ids: set[int] = set()
        self.steps = 0
        self.answers: list[tuple] = []  # each (tokens, load_kv_async) kvtier answered vLLM's lookups
        lookup = self.connector.get_num_new_matched_tokens

        def recorded(request, num_computed_tokens):
            answer = lookup(request, num_computed_tokens)
            self.answers.append(answer)
            return answer
        self.connector.get_num_new_matched_tokens = recorded  # what vLLM's scheduler calls
        self.delayed_frees = 0  # finished requests whose blocks vLLM kept for kvtier's stores
        finished = self.connector.request_finished

        def recorded_finish(request, block_ids):
            answer = finished(request, block_ids)
            self.delayed_frees += bool(answer[0])
            return answer
        self.connector.request_finished = recorded_finish

    # --- requests -------------------------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2, **params):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
        request = Request(req_id, list(prompt), sampling, None,
                          block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.scheduler.add_request(request)
        self.outputs[req_id] = []
        return request

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # --- the engine step --------------------------------------------------------------------------
    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        self.steps += 1
        output = self.last_output = self.scheduler.schedule()
        if output.total_num_scheduled_tokens == 0:
            runner_output = self.worker.no_forward(output)
        else:
            self.worker.pre_forward(output)
            sampled = self.forward(output)
            self.worker.finish_forward()
            connector_output = self.worker.post_forward(output.finished_req_ids)
            fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
            req_ids = list(sampled)
            args = dict(req_ids=req_ids, sampled_token_ids=[sampled[r] for r in req_ids], logprobs=None,
                        prompt_logprobs_dict={}, pooler_output=[], kv_connector_output=connector_output)
            if "req_id_to_index" in fields:
                args["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
            runner_output = ModelRunnerOutput(**{k: v for k, v in args.items() if k in fields})
        kv_output = runner_output.kv_connector_output
        if kv_output is not None and kv_output.invalid_block_ids:
            self.invalid_block_ids |= set(kv_output.invalid_block_ids)
        for outputs in self.scheduler.update_from_output(output, runner_output).values():
            for out in outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    def forward(self, output) -> dict[str, list[int]]:
        """Layer by layer, as vLLM's attention layers call the connector: wait for the layer's
        loads, check the KV of every token before each scheduled one that this loop did not
        compute, write the scheduled tokens' KV, hand the layer to the connector. Returns the
        sampled token of each request whose prompt is computed."""
        starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        work = []
        for req_id, count in output.num_scheduled_tokens.items():
            tokens = list(self.scheduler.requests[req_id].all_token_ids)
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            start = starts[req_id]
            done = self.computed.get(req_id, 0)
            if done > start:
                done = 0  # preempted and resumed: its blocks are new, every token's KV checked again
            work.append((req_id, tokens, blocks, done, start, count))
        for layer, name in enumerate(self.layers):
            self.worker_connector.wait_for_layer_load(name)
            for req_id, tokens, blocks, done, start, count in work:
                for position in range(done, start):  # counted as computed, not by this loop: loaded or cached
                    self._check(tokens, position, blocks, layer)
                for position in range(start, start + count):
                    self._write(tokens, position, blocks, layer)
            self.worker_connector.save_kv_layer(name, self.caches[name], None)
        sampled = {}
        for req_id, tokens, blocks, done, start, count in work:
            self.checked_tokens += start - done
            self.computed[req_id] = start + count
            sampled[req_id] = [value_of(tokens[:start + count]) % 1000 + 10] if start + count >= len(tokens) else []
        return sampled

    def _kv(self, tokens, position: int, layer: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(value_of(tokens[:position + 1]) + layer)
        return torch.randn(HEADS, 2 * HEAD_SIZE, generator=generator).to(torch.bfloat16)

    def _write(self, tokens, position, blocks, layer) -> None:
        block, offset = blocks[position // self.block_size], position % self.block_size
        self.caches[self.layers[layer]][block, :, offset, :] = self._kv(tokens, position, layer)

    def _check(self, tokens, position, blocks, layer) -> None:
        block, offset = blocks[position // self.block_size], position % self.block_size
        found = self.caches[self.layers[layer]][block, :, offset, :]
        expected = self._kv(tokens, position, layer)
        assert torch.equal(found.view(torch.int16), expected.view(torch.int16)), \
            f"token {position}'s KV in layer {layer} (block {block}) is not what computing it wrote"

    # --- driving ----------------------------------------------------------------------------------
    def run(self, max_steps: int = 2000, until=None) -> None:
        """Step until every request finished and kvtier has nothing pending (or ``until()``)."""
        for _ in range(max_steps):
            if until is not None and until():
                return
            if until is None and not self.scheduler.has_requests() and not self.connector.has_pending_push_work():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def side(self):
        return self.connector._scheduler_side

    def assert_nothing_held(self) -> None:
        """vLLM's scheduler and kvtier both back to empty: no request, block, pin or job left."""
        scheduler = self.scheduler
        assert not scheduler.requests and not scheduler.running and not len(scheduler.waiting)
        assert not scheduler.finished_recving_kv_req_ids
        pool = scheduler.kv_cache_manager.block_pool
        assert all(block.ref_cnt == 0 for block in pool.blocks)
        side = self.side()
        assert len(side.requests) == 0 and side.num_pending_jobs == 0 and not side.has_pending_work
        assert side.manager.host.num_pins == 0
        assert self.worker_connector._worker_side.num_send_waits == 0

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        self.worker_connector.shutdown()
        self.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        # vLLM's scheduler and this loop hold each other: dropped now, the host pool goes with them,
        # not at the garbage collector's next look for cycles.
        self.__dict__.clear()
