"""Small safetensors "models" written by hand, and pushes made from them."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SHAPES = {"embed.weight": (16, 8), "layer.0.weight": (8, 8), "norm.weight": (8,)}
"""The served model's tensors (float32), split over two files as a sharded checkpoint would."""
FILES = {
    "model-00001-of-00002.safetensors": ("embed.weight",),
    "model-00002-of-00002.safetensors": ("layer.0.weight", "norm.weight"),
}


def write_model(
    directory: Path, seed: int, shapes: dict[str, tuple[int, ...]] | None = None
) -> Path:
    """Weights for ``SHAPES`` (or ``shapes`` in one file) drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    if shapes is not None:
        tensors = {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    for name, names in FILES.items():
        tensors = {n: rng.standard_normal(SHAPES[n], dtype=np.float32) for n in names}
        save_file(tensors, str(directory / name))
    return directory


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_sums(directory: Path) -> None:
    lines = [f"{sha256(p)}  {p.name}\n" for p in sorted(directory.glob("*.safetensors"))]
    (directory / "SHA256SUMS").write_text("".join(lines))


def raw_safetensors(path: Path, header: dict[str, object], data: bytes) -> None:
    """A file with exactly this header and data, however wrong."""
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
