"""What both sides of the connector derive from vLLM's configuration, identically."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

from kvtier.common.config import KVTierConfig
from kvtier.common.keys import Namespace
from kvtier.common.model_identity import directory_fingerprint, model_fingerprint


@dataclass(frozen=True)
class EngineGeometry:
    namespace: Namespace
    slot_bytes: int  # one block, all layers, one rank
    layer_names: list[str]  # slot order: the KV cache group's layer order
    num_blocks: int
    block_size: int
    tp_size: int
    tp_rank_count: int  # workers that report each job (tensor x pipeline parallel): kvtier's ranks
    extends_loaded_kv: bool = True  # False: the engine cannot use loaded KV (``_extends_loaded_kv``)
    # Sliding-window layers alone, the window shorter than max_model_len: vLLM frees a request's blocks
    # as they leave the window (``sliding_window`` tokens, and any it retains below), mid-request.
    # 0: it keeps every block.
    sliding_window: int = 0

    def skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks of a request that vLLM may have freed (or padded with its null block) once
        ``num_computed`` tokens are computed: vLLM's own ``get_num_skipped_tokens``, whole blocks."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def first_read(self, start: int, num_full: int, num_tokens: int) -> Callable[[int], int] | None:
        """For a lookup of a request's blocks from ``start`` on (``num_full`` full ones, then its partial
        one): of a hit of n of them, the first that vLLM reads, the first within the window of the hit's
        next token (vLLM gives those before it its null block). None: vLLM reads every block of a hit."""
        if not self.sliding_window:
            return None

        def first_read(n: int) -> int:
            tokens = num_tokens if start + n > num_full else (start + n) * self.block_size
            return max(0, self.skipped_blocks(tokens) - start)
        return first_read


def engine_geometry(vllm_config, kv_cache_config, config: KVTierConfig) -> EngineGeometry:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvtier supports models with one KV cache group (full attention); this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    max_model_len = vllm_config.model_config.max_model_len
    _check_every_token_kept(spec)
    is_mla = isinstance(spec, MLAAttentionSpec)
    layer_names = list(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    kv_dtype = _kv_dtype(spec.dtype, vllm_config.cache_config)
    namespace = _namespace(config, vllm_config.model_config, kv_dtype, is_mla, spec.num_kv_heads, spec.head_size,
                           len(layer_names), spec.block_size, parallel.tensor_parallel_size)
    return EngineGeometry(namespace, spec.page_size_bytes * len(layer_names), layer_names,
                          kv_cache_config.num_blocks, spec.block_size, parallel.tensor_parallel_size,
                          parallel.world_size, _extends_loaded_kv(vllm_config, is_mla), _frees_past(spec, max_model_len))


def worker_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """A worker's rank to kvtier: its place among the engine's workers, stage by stage. Each pipeline
    stage holds its own layers, so each of its workers stores entries of its own (the tensor-parallel
    rank alone, without pipeline parallelism)."""
    return pp_rank * tp_size + tp_rank


def _extends_loaded_kv(vllm_config, is_mla: bool) -> bool:
    """Whether the engine computes a prompt's tokens over KV loaded for the tokens before them.
    vLLM's CPU MLA attention (all but the AMX one) does not: vLLM turns its own prefix caching and
    chunked prefill off for it, and every load there, down to a whole prompt's but its last token,
    gave other outputs than recompute. An engine with chunked prefill on computes over earlier KV
    every chunk."""
    on_cpu = getattr(vllm_config.device_config, "device_type", "") == "cpu"
    return not (is_mla and on_cpu and not vllm_config.scheduler_config.enable_chunked_prefill)


def _frees_past(spec, max_model_len: int) -> int:
    """The tokens before the next one that vLLM keeps a request's blocks for (its sliding window, and
    the ``extra_retained_tokens`` below it that multi-token prediction re-reads), or 0 where it frees none."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if type(spec) is not SlidingWindowSpec:
        return 0
    kept = spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)  # the field is new in vLLM 0.32
    return kept if kept < max_model_len else 0


def _check_every_token_kept(spec) -> None:
    """kvtier stores and loads a prompt's blocks, each keyed by the tokens up to its end: a block's
    KV must depend on those tokens alone, and the blocks a load needs must be kept. A model that
    mixes sliding-window (or chunked local) layers with full-attention ones passes: without vLLM's
    hybrid cache manager (off on CPU, and with any connector that does not declare it), its local
    layers get full-attention blocks, every token kept, and only compute within their window
    (``FullAttentionSpec`` with its ``sliding_window`` or ``attention_chunk_size`` noted). So does a
    model of sliding-window layers alone: vLLM frees the blocks before token ``n - window + 1`` at
    ``n`` tokens computed (none while ``window >= max_model_len``), and kvtier stores each block in
    the step that computes it, before it can be freed, and loads only the blocks within the window
    (``EngineGeometry.sliding_window``). Chunked local attention alone frees whole chunks at a time
    and is not served."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec):
        raise ValueError(f"kvtier needs a KV cache of full-attention or sliding-window blocks; this model's is "
                         f"{type(spec).__name__} (chunked local layers alone free their blocks chunk by chunk)")
    if getattr(spec, "non_causal", False):
        raise ValueError("kvtier keys each block by the tokens before it, but this model's attention is "
                         "non-causal (a prefix LM): a block's KV depends on the tokens after it")


def offline_namespace(model: str, engine_args: dict, config: KVTierConfig) -> Namespace:
    """The namespace that vLLM started with ``model`` and ``engine_args`` (``EngineArgs`` fields:
    block_size, dtype, kv_cache_dtype, tensor_parallel_size, ...) would key blocks with, from
    vLLM's own configuration, without starting an engine (``kvtier doctor --model``)."""
    from vllm.engine.arg_utils import EngineArgs

    vllm_config = EngineArgs(model=model, **engine_args).create_engine_config()
    model_config, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if cache.cache_dtype == "auto":
        kv_dtype = model_config.dtype
    else:
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
        kv_dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model_config)
    return _namespace(config, model_config, _kv_dtype(kv_dtype, cache), bool(getattr(model_config, "use_mla", False)),
                      model_config.get_num_kv_heads(parallel), model_config.get_head_size(),
                      model_config.get_num_layers(parallel), cache.block_size, parallel.tensor_parallel_size)


# vLLM's names of one format: "fp8" is fp8_e4m3 wherever vLLM offers both.
_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def _kv_dtype(tensor_dtype, cache_config) -> str:
    """What the cache's bytes mean. A floating-point tensor's dtype says it; vLLM keeps every
    quantized format (fp8 e4m3 and e5m2, per-token-head int8, nvfp4, ...) in uint8 or int8
    tensors, whose dtype does not: there the format, and the layers left unquantized, are named,
    so that one format's blocks never load into another's cache."""
    tensor_dtype = str(tensor_dtype)
    if tensor_dtype.startswith("torch.float") or tensor_dtype == "torch.bfloat16":
        return tensor_dtype
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    skipped = ",".join(str(layer) for layer in getattr(cache_config, "kv_cache_dtype_skip_layers", None) or ())
    return f"{tensor_dtype}:{_CACHE_DTYPE_ALIASES.get(cache_dtype, cache_dtype)}" + (f":skip={skipped}" if skipped else "")


def _namespace(config: KVTierConfig, model_config, kv_dtype: str, is_mla: bool, num_kv_heads: int, head_size: int,
               num_layers: int, block_size: int, tp_size: int) -> Namespace:
    """The one place both the running connector and ``kvtier doctor`` make a namespace."""
    return Namespace(
        model=config.model_id or _model_name(str(model_config.model)),
        kv_dtype=kv_dtype,
        layout="mla" if is_mla else "kv",
        geometry=(head_size,) if is_mla else (num_kv_heads, head_size),
        num_layers=num_layers,
        block_size=block_size,
        tp_size=tp_size,
        weights=_weights(model_config),
    )


def _model_name(model: str) -> str:
    """A hub name as it is; a local directory by its content alone (``weights``), not its path, so
    that instances that mount the same files at other paths share their KV."""
    return "" if os.path.exists(model) else model


def _weights(model_config) -> str:
    """The model's fingerprint: its files' content where they are on this machine (a local
    directory, or vLLM's download in the Hugging Face cache), plus the settings that change
    the KV it computes. Both sides of the connector compute it alike."""
    model, revision = str(model_config.model), getattr(model_config, "revision", None)
    local = model
    if not os.path.exists(model):
        try:
            from huggingface_hub import snapshot_download
            local = snapshot_download(model, revision=revision, local_files_only=True)
        except Exception:  # not in the cache (or not a hub name): the name and revision stand for it
            local = model
    settings = {name: str(getattr(model_config, name, None))
                for name in ("dtype", "quantization", "hf_overrides", "override_generation_config")}
    if not os.path.exists(model):
        settings["name"] = model  # a hub name (or a name with no files here) stands for the model
    return _fingerprint(local, revision, tuple(sorted(settings.items())))


@functools.lru_cache(maxsize=8)
def _fingerprint(local: str, revision: str | None, settings: tuple) -> str:
    """Once per process: the scheduler and a worker in its process read the files once."""
    return model_fingerprint(local, revision, dict(settings))


_adapters: dict[tuple, str] = {}


def adapter_fingerprint(lora_request) -> str:
    """A LoRA adapter's content fingerprint, computed once per version of its files (their
    paths, sizes and modification times): a few stats per new request, not a read."""
    path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "lora_local_path", None)
    if not path or not os.path.exists(path):
        return f"id={getattr(lora_request, 'lora_int_id', '')}"
    files = [path] if os.path.isfile(path) else sorted(os.path.join(d, f) for d, _, names in os.walk(path)
                                                       for f in names)
    version = tuple((f, st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])
    found = _adapters.get(version)
    if found is None:
        if len(_adapters) > 1024:
            _adapters.clear()
        found = _adapters[version] = directory_fingerprint(path)
    return found
