"""Random-weight models, generated locally (nothing is downloaded): a Llama- or Qwen3-architecture
one, an MLA one (DeepSeek-V2 architecture), and LoRA adapters for the first."""

from __future__ import annotations

import json
from pathlib import Path


def make_model(path: str | Path, num_layers: int = 4, hidden_size: int = 256, num_heads: int = 4,
               num_kv_heads: int = 2, vocab_size: int = 2048, max_positions: int = 8192,
               initializer_range: float = 0.3, seed: int = 0, layer_types: list[str] | None = None,
               sliding_window: int | None = None, architecture: str = "llama", head_dim: int | None = None) -> Path:
    """Write a model directory once; an existing one with the same settings is reused. ``layer_types``
    ("full_attention" or "sliding_attention" per layer) with ``sliding_window``: a model whose
    sliding layers attend to that many tokens only. ``architecture`` "qwen3": a Qwen3 one instead
    (RMS-normed queries and keys, untied embeddings), whose ``head_dim`` may differ from
    ``hidden_size // num_heads``, as Qwen3's do."""
    if architecture not in ("llama", "qwen3"):
        raise ValueError(f"architecture {architecture!r} is not llama or qwen3")
    if architecture != "llama" and layer_types is not None:
        raise ValueError("layer_types (sliding-window layers) are made for the llama architecture only")
    path = Path(path)
    settings = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    vocab_size=vocab_size, max_positions=max_positions, initializer_range=initializer_range, seed=seed)
    if layer_types is not None:
        settings.update(layer_types=list(layer_types), sliding_window=sliding_window)
    if architecture != "llama" or head_dim is not None:
        settings.update(architecture=architecture, head_dim=head_dim)
    if _written(path, settings):
        return path
    import torch
    import transformers

    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                 num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                 head_dim=head_dim or hidden_size // num_heads, max_position_embeddings=max_positions,
                 initializer_range=initializer_range, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    if architecture == "qwen3":
        config = transformers.Qwen3Config(**shape, tie_word_embeddings=False)
        return _write(path, transformers.Qwen3ForCausalLM(config).to(torch.bfloat16), settings)
    config = transformers.LlamaConfig(**shape)
    if layer_types is not None:  # read by vLLM's Llama (and written to config.json with the rest)
        config.layer_types, config.sliding_window = list(layer_types), sliding_window
    return _write(path, transformers.LlamaForCausalLM(config).to(torch.bfloat16), settings)


def make_mla_model(path: str | Path, num_layers: int = 2, hidden_size: int = 256, num_heads: int = 4,
                   vocab_size: int = 2048, seed: int = 0) -> Path:
    """A random-weight DeepSeek-V2-architecture model (multi-head latent attention, dense layers): a
    latent KV of 512 plus 64 rotary dimensions per token, the one size vLLM's CPU MLA kernel takes."""
    path = Path(path)
    settings = dict(kind="mla", num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                    vocab_size=vocab_size, seed=seed)
    if _written(path, settings):
        return path
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, first_k_dense_replace=num_layers,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        max_position_embeddings=8192, initializer_range=0.3, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    return _write(path, DeepseekV2ForCausalLM(config).to(torch.bfloat16), settings)


def make_lora_adapter(path: str | Path, model: str | Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter (PEFT's format) on the attention's q and v projections of a model
    ``make_model`` wrote, large enough to change its outputs."""
    import torch
    from safetensors.torch import save_file

    path, config = Path(path), json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for projection, out_features in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, config["hidden_size"], generator=generator) * 0.3
            weights[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(outputs), "base_model_name_or_path": str(model)}))
    return path


def _written(path: Path, settings: dict) -> bool:
    """A model directory with these settings is there already."""
    marker = path / "kvtier_model.json"
    return marker.exists() and json.loads(marker.read_text()) == settings


def _write(path: Path, model, settings: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(settings["vocab_size"]).save_pretrained(path)
    (path / "kvtier_model.json").write_text(json.dumps(settings))  # last: a directory cut short is written again
    return path


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer: token i is the word ``w<i>`` (ids 0-2 are special)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def words(token_ids) -> str:
    """The text that the generated tokenizer turns into exactly ``token_ids``."""
    return " ".join(f"w{t}" for t in token_ids)
