"""Safetensors headers against the served model: what is refused, and the message that says why."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rolloutd.weights import layout as layout_module
from rolloutd.weights.layout import (
    HEADER_FLOOR,
    MAX_HEADER_BYTES,
    ModelLayout,
    TensorSpec,
    WeightsRejected,
    read_header,
    weights_file,
)
from tests.weights.helpers import SHAPES, raw_safetensors, write_model


@pytest.fixture
def layout(tmp_path: Path) -> ModelLayout:
    return ModelLayout.of_directory(write_model(tmp_path / "served", seed=0))


def files(directory: Path) -> dict[str, Path]:
    return {p.name: p for p in directory.glob("*.safetensors")}


def test_the_layout_is_every_tensor_of_the_served_model(layout: ModelLayout) -> None:
    assert dict(layout.tensors) == {n: TensorSpec("F32", s) for n, s in SHAPES.items()}


def test_new_weights_of_the_same_layout_pass(layout: ModelLayout, tmp_path: Path) -> None:
    layout.check(files(write_model(tmp_path / "new", seed=1)))


def test_a_misshapen_tensor_is_named_with_both_shapes(layout: ModelLayout, tmp_path: Path) -> None:
    new = write_model(tmp_path / "new", seed=1, shapes={**SHAPES, "layer.0.weight": (8, 9)})
    with pytest.raises(WeightsRejected, match=r"model.safetensors: tensor layer.0.weight is "
                       r"F32\[8, 9\], the served model's is F32\[8, 8\]"):  # fmt: skip
        layout.check(files(new))


def test_another_dtype_is_refused(layout: ModelLayout, tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float16) for n, s in SHAPES.items()}
    save_file(tensors, str(tmp_path / "new" / "model.safetensors"))
    with pytest.raises(
        WeightsRejected, match=r"tensor \S+ is F16\[.*\], the served model's is F32"
    ):
        layout.check(files(tmp_path / "new"))


def test_an_unknown_tensor_is_named(layout: ModelLayout, tmp_path: Path) -> None:
    new = write_model(tmp_path / "new", seed=1, shapes={**SHAPES, "lm_head.weight": (16, 8)})
    with pytest.raises(
        WeightsRejected, match=r"tensor lm_head.weight is not a tensor of the served model"
    ):
        layout.check(files(new))


def test_missing_tensors_are_counted_and_named(layout: ModelLayout, tmp_path: Path) -> None:
    shapes = {"embed.weight": SHAPES["embed.weight"]}
    new = write_model(tmp_path / "new", seed=1, shapes=shapes)
    with pytest.raises(WeightsRejected, match=r"2 tensors of the served model are missing: "
                       r"layer.0.weight, norm.weight"):  # fmt: skip
        layout.check(files(new))


def test_a_tensor_in_two_files_is_refused(layout: ModelLayout, tmp_path: Path) -> None:
    new = write_model(tmp_path / "new", seed=1)
    extra = write_model(tmp_path / "extra", seed=2, shapes={"norm.weight": (8,)})
    both = {**files(new), "extra.safetensors": extra / "model.safetensors"}
    with pytest.raises(WeightsRejected, match=r"tensor norm.weight is also in"):
        layout.check(both)


def test_a_truncated_file_is_refused_before_its_tensors_are_read(tmp_path: Path) -> None:
    path = write_model(tmp_path / "new", seed=1, shapes=SHAPES) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(WeightsRejected, match="model.safetensors: the header describes "
                       r"\d+ bytes of tensor data but the file holds \d+ \(truncated"):  # fmt: skip
        read_header(path)
    path.write_bytes(data[:5])
    with pytest.raises(WeightsRejected, match=r"^model\.safetensors: not a safetensors file$"):
        read_header(path)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4,
         r"tensor t: 4 bytes do not hold F32\[2\]"),
        ({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8,
         "tensor t: unknown dtype 'Q4'"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8,
         "shape .* is not a list of sizes"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8,
         "data_offsets .* are invalid"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12,
         "padded"),
    ],
)  # fmt: skip
def test_malformed_headers_are_refused(
    tmp_path: Path, header: dict[str, object], data: bytes, message: str
) -> None:
    raw_safetensors(tmp_path / "x.safetensors", header, data)
    with pytest.raises(WeightsRejected, match=message):
        read_header(tmp_path / "x.safetensors")


def test_a_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(WeightsRejected, match=r"not a safetensors file \(its header is not JSON\)"):
        read_header(path)


def test_a_file_that_is_not_safetensors_leaks_nothing_of_itself(tmp_path: Path) -> None:
    """What /etc/passwd would have answered: its first bytes as a length, and its size."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 100)
    with pytest.raises(WeightsRejected) as info:
        read_header(path)
    assert str(info.value) == "x.safetensors: not a safetensors file"
    path.write_bytes((6).to_bytes(8, "little") + b"\xffroot:")
    with pytest.raises(WeightsRejected) as info:
        read_header(path)
    assert "0xff" not in str(info.value) and "root" not in str(info.value)


def test_a_header_larger_than_the_served_model_needs_is_refused_unread(
    layout: ModelLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A legal header of 3 MiB of metadata: the served model's headers are a few hundred bytes,
    so anything past the floor is refused before the JSON is read."""
    assert 0 < layout.header_bytes < 1000
    assert layout.max_header == HEADER_FLOOR
    new = tmp_path / "new"
    new.mkdir()
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s, dtype=np.float32) for n, s in SHAPES.items()}
    save_file(tensors, str(new / "model.safetensors"), metadata={"pad": "x" * 3 * 2**20})
    parsed: list[int] = []
    real_loads = layout_module.json.loads
    monkeypatch.setattr(
        layout_module.json, "loads", lambda raw: parsed.append(len(raw)) or real_loads(raw)
    )
    with pytest.raises(WeightsRejected, match=r"^model.safetensors: its header of \d+ bytes is "
                       r"larger than the served model needs \(at most 1048576: 2 times the "
                       r"served model's headers\)$"):  # fmt: skip
        layout.check(files(new))
    assert parsed == [], "the oversized header was parsed"
    # The same tensors with a header of ordinary size pass.
    save_file(tensors, str(new / "model.safetensors"), metadata={"format": "pt"})
    layout.check(files(new))


def test_the_cap_follows_the_served_headers(tmp_path: Path) -> None:
    layout = ModelLayout({}, "m", header_bytes=10 * 2**20)
    assert layout.max_header == 2 * 10 * 2**20
    assert ModelLayout({}, "m", header_bytes=80 * 2**20).max_header == MAX_HEADER_BYTES


def test_weights_files_must_stay_in_their_directory(tmp_path: Path) -> None:
    weights = write_model(tmp_path / "w", seed=1)
    outside = write_model(tmp_path / "elsewhere", seed=2, shapes=SHAPES) / "model.safetensors"
    inside = sorted(weights.glob("*.safetensors"))[0]
    (weights / "alias.safetensors").symlink_to(inside.name)
    assert weights_file(weights / "alias.safetensors", weights) == weights / "alias.safetensors"
    for name, target in [("passwd.safetensors", Path("/etc/passwd")), ("out.safetensors", outside)]:
        (weights / name).symlink_to(target)
        with pytest.raises(WeightsRejected) as info:
            weights_file(weights / name, weights)
        assert str(info.value) == f"{name}: not a safetensors file"
    os.mkfifo(weights / "fifo.safetensors")
    with pytest.raises(WeightsRejected, match=r"^fifo\.safetensors: not a safetensors file$"):
        weights_file(weights / "fifo.safetensors", weights)
