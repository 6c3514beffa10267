"""The delta format: made from state dicts or directories, applied exactly, and refused tensor by
tensor when it does not fit the weights it is applied to or was damaged."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rolloutd.weights import delta
from rolloutd.weights.layout import WeightsRejected
from tests.weights.helpers import write_model


def _bf16_step(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """One small optimizer-like step in float32, cast back to bf16: most bits stay the same."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: (t.float() + 1e-3 * torch.randn(t.shape, generator=g)).to(t.dtype)
        for n, t in tensors.items()
    }


@pytest.fixture
def bf16(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layer.0.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(32, dtype=torch.bfloat16),
    }
    new = _bf16_step(base, seed=1)
    new["norm.weight"] = base["norm.weight"].clone()  # untouched tensors cost nothing
    for name, tensors in (("base", base), ("new", new)):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    return tmp_path / "base", tmp_path / "new", base, new


def test_a_delta_reproduces_the_new_weights_byte_for_byte(bf16, tmp_path: Path) -> None:
    base_dir, new_dir, base, new = bf16
    stats = delta.make_delta(base, new, tmp_path / "d.delta", base_version=4, version=5)
    assert (stats.base_version, stats.version, stats.tensors_changed) == (4, 5, 2)
    assert 0 < stats.density < 1
    assert stats.bytes < stats.full_bytes
    out = tmp_path / "out"
    out.mkdir()
    applied = delta.apply_delta(tmp_path / "d.delta", base_dir, out)
    assert sorted(applied.changed_tensors) == ["embed.weight", "layer.0.weight"]
    assert (out / "model.safetensors").read_bytes() == (new_dir / "model.safetensors").read_bytes()
    # The same delta from the directories as from the state dicts.
    again = delta.make_delta(base_dir, new_dir, tmp_path / "e.delta", base_version=4, version=5)
    assert (tmp_path / "e.delta").read_bytes() == (tmp_path / "d.delta").read_bytes()
    assert again == stats


def test_each_tensor_takes_the_smaller_encoding(tmp_path: Path) -> None:
    base = {"sparse": np.zeros(4096, np.float32), "dense": np.zeros(4096, np.float32)}
    new = {"sparse": base["sparse"].copy(), "dense": np.arange(4096, dtype=np.float32)}
    new["sparse"][[7, 1000]] = 1.5
    delta.make_delta(base, new, tmp_path / "d.delta", base_version=0, version=1)
    entries = delta.read_header(tmp_path / "d.delta").entries
    assert (entries["sparse"].encoding, entries["sparse"].changed) == ("values", 2)
    assert (entries["dense"].encoding, entries["dense"].changed) == ("xor", 4095)


def test_sharded_float32_models_apply_file_by_file(tmp_path: Path) -> None:
    base, new = write_model(tmp_path / "a", seed=0), write_model(tmp_path / "b", seed=1)
    delta.make_delta(base, new, tmp_path / "d.delta", base_version=0, version=1)
    out = tmp_path / "out"
    out.mkdir()
    delta.apply_delta(tmp_path / "d.delta", base, out)
    for p in new.glob("*.safetensors"):
        assert (out / p.name).read_bytes() == p.read_bytes()


def _out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return out


def test_applied_to_other_weights_the_tensor_is_named(bf16, tmp_path: Path) -> None:
    base_dir, _, base, new = bf16
    delta.make_delta(base, new, tmp_path / "d.delta", base_version=4, version=5)
    other = dict(base)
    other["layer.0.weight"] = _bf16_step({"x": base["layer.0.weight"]}, seed=9)["x"]
    save_file(other, str(base_dir / "model.safetensors"))
    with pytest.raises(WeightsRejected, match=r"tensor layer\.0\.weight: the result's SHA-256"):
        delta.apply_delta(tmp_path / "d.delta", base_dir, _out(tmp_path))


def test_a_truncated_delta_names_the_cut_tensor(bf16, tmp_path: Path) -> None:
    base_dir, _, base, new = bf16
    path = tmp_path / "d.delta"
    delta.make_delta(base, new, path, base_version=4, version=5)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightsRejected, match=r"tensor layer.0.weight: payload ends .* truncated"):
        delta.apply_delta(path, base_dir, _out(tmp_path))


def test_a_flipped_bit_in_a_payload_names_the_tensor(bf16, tmp_path: Path) -> None:
    base_dir, _, base, new = bf16
    path = tmp_path / "d.delta"
    delta.make_delta(base, new, path, base_version=4, version=5)
    header = delta.read_header(path)
    entry = header.entries["embed.weight"]
    data = bytearray(path.read_bytes())
    data[header.data_start + (entry.begin + entry.end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsRejected, match=r"tensor embed\.weight: "):
        delta.apply_delta(path, base_dir, _out(tmp_path))


def test_a_delta_for_another_model_is_refused(bf16, tmp_path: Path) -> None:
    base_dir, _, base, new = bf16
    new = {**new, "layer.0.weight": new["layer.0.weight"][:16]}
    with pytest.raises(ValueError, match=r"tensor layer\.0\.weight is BF16\[16, 32\]"):
        delta.make_delta(base, new, tmp_path / "d.delta", base_version=4, version=5)
    small = {n: t for n, t in base.items() if n != "norm.weight"}
    delta.make_delta(small, small, tmp_path / "d.delta", base_version=4, version=5)
    with pytest.raises(WeightsRejected, match="1 tensors of the served model are missing"):
        delta.apply_delta(tmp_path / "d.delta", base_dir, _out(tmp_path))


def test_malformed_headers_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.delta"
    path.write_bytes(b"not a delta at all")
    with pytest.raises(WeightsRejected, match="is not a delta file"):
        delta.read_header(path)
    header = json.dumps({"format": "other", "format_version": 1}).encode()
    path.write_bytes(delta.MAGIC + struct.pack("<Q", len(header)) + header)
    with pytest.raises(WeightsRejected, match="format 'other'"):
        delta.read_header(path)
