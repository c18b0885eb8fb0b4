"""A random-weight Llama-architecture model, generated locally (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path


def make_model(path: str | Path, num_layers: int = 4, hidden_size: int = 256, num_heads: int = 4,
               num_kv_heads: int = 2, vocab_size: int = 2048, max_positions: int = 8192,
               initializer_range: float = 0.3, seed: int = 0) -> Path:
    """Write a model directory once; an existing one with the same settings is reused."""
    path = Path(path)
    settings = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    vocab_size=vocab_size, max_positions=max_positions, initializer_range=initializer_range, seed=seed)
    marker = path / "kvtier_model.json"
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, initializer_range=initializer_range, torch_dtype="bfloat16",
        bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(settings))
    return path
