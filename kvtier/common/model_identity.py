"""What the KV of a model depends on, as one short fingerprint. Torch-free, engine-free.

Two caches' blocks are interchangeable only when the weights that computed them are the
same, not merely the model's name: a model updated in place, another revision, another
quantization or a LoRA adapter reloaded under the same name must never be served the old
KV. ``directory_fingerprint`` identifies a model (or adapter) directory by content:
every configuration file whole, and every weight file by its name, its size and 16
samples of 64 KiB spread over it (a fine-tune changes bytes everywhere; the samples cost
about 1 MiB of reads per file, not a read of the whole model). Modification times are
left out: a copy of the same files gives the same fingerprint.
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3

SAMPLES = 16
SAMPLE_BYTES = 64 << 10
_CONFIG_SUFFIXES = (".json", ".txt", ".model", ".yaml", ".yml", ".py", ".jinja")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")


def directory_fingerprint(path: str | os.PathLike) -> str:
    """Hex fingerprint of a model or adapter directory's content (a file: that file)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts)
    digest = blake3.blake3(b"kvtier-model")
    for file in files:
        name = file.name if file == root else file.relative_to(root).as_posix()
        if file.suffix in _WEIGHT_SUFFIXES or file == root:
            digest.update(f"\0weights\0{name}\0".encode())
            _sample(file, digest)
        elif file.suffix in _CONFIG_SUFFIXES:
            digest.update(f"\0file\0{name}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest(length=16)


def _sample(file: Path, digest) -> None:
    size = file.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with open(file, "rb") as stream:
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(stream.read())
            return
        step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
        for i in range(SAMPLES):  # the first and the last bytes included
            stream.seek(i * step)
            digest.update(stream.read(SAMPLE_BYTES))


def model_fingerprint(model: str, revision: str | None = None, settings: dict | None = None) -> str:
    """The model part of a cache's namespace: the directory's content where ``model`` is one on
    this machine (else its name and ``revision``), and the engine settings that change the KV
    (``settings``: dtype, quantization, configuration overrides, ...)."""
    parts = [f"revision={revision}"] + [f"{key}={settings[key]!r}" for key in sorted(settings or {})]
    content = directory_fingerprint(model) if os.path.exists(model) else f"name={model}"
    return blake3.blake3("\0".join([content, *parts]).encode()).hexdigest(length=16)
