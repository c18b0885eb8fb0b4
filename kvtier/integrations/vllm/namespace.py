"""What both sides of the connector derive from vLLM's configuration, identically."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import KVTierConfig
from kvtier.keys import Namespace


@dataclass(frozen=True)
class EngineGeometry:
    namespace: Namespace
    slot_bytes: int  # one block, all layers, one rank
    layer_names: list[str]  # slot order: the KV cache group's layer order
    num_blocks: int
    block_size: int
    tp_size: int
    tp_rank_count: int  # workers that report each job (tensor x pipeline parallel)


def engine_geometry(vllm_config, kv_cache_config, config: KVTierConfig) -> EngineGeometry:
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvtier supports models with one KV cache group (full attention); this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec) or getattr(spec, "sliding_window", None):
        raise ValueError(f"kvtier supports full-attention KV caches, not {type(spec).__name__}")
    is_mla = isinstance(spec, MLAAttentionSpec)
    layer_names = list(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    namespace = Namespace(
        model=config.model_id or str(vllm_config.model_config.model),
        kv_dtype=str(spec.dtype),
        layout="mla" if is_mla else "kv",
        geometry=(spec.head_size,) if is_mla else (spec.num_kv_heads, spec.head_size),
        num_layers=len(layer_names),
        block_size=spec.block_size,
        tp_size=parallel.tensor_parallel_size,
    )
    return EngineGeometry(namespace, spec.page_size_bytes * len(layer_names), layer_names,
                          kv_cache_config.num_blocks, spec.block_size, parallel.tensor_parallel_size,
                          parallel.world_size)
