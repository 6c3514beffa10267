"""The served model's tensors, and new weights checked against them before any engine sees them.

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
every tensor with its dtype, shape and byte range; the data follows, back to back. Reading the
headers is enough to refuse, without loading a byte of data, new weights that would leave the
model half-replaced: an unknown tensor, a missing one, one with another shape or dtype, or a file
whose data is shorter or longer than its header says.

The JSON header is parsed whole, so its size bounds the memory and time a check takes: new
weights may have a header at most ``HEADER_MARGIN`` times the served model's (all its files
together), or ``HEADER_FLOOR``, whichever is larger. A file that is not a safetensors file (too
short, a header length that does not fit, a header that is not JSON, a symlink leaving its
directory, not a regular file) is refused with just that: the message says nothing of what the
file holds, which could be any file the service can read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rolloutd.domain.errors import InvalidArgument

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 * 2**20
"""The safetensors format's own limit on the JSON header: the cap without a served model."""
HEADER_MARGIN = 2
"""New weights' headers may be this many times the served model's (other metadata, key order)."""
HEADER_FLOOR = 2**20
"""Headers up to this size pass whatever the served model's: parsing them costs little."""
NOT_SAFETENSORS = "not a safetensors file"

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
"""Bytes per element of each safetensors dtype."""


class WeightsRejected(InvalidArgument):
    """New weights that must not reach the engine; ``field`` names the file (or ``weights``)."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def read_header(
    path: Path, name: str | None = None, *, max_header: int = MAX_HEADER_BYTES
) -> dict[str, TensorSpec]:
    """The tensors of one safetensors file, after checking that its header is well-formed, at
    most ``max_header`` bytes, and that the data it describes fills the file exactly (a truncated
    or padded file is refused)."""
    label = name or path.name
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightsRejected(label, NOT_SAFETENSORS)
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise WeightsRejected(label, NOT_SAFETENSORS)
        if length > max_header:
            raise WeightsRejected(
                label,
                f"its header of {length} bytes is larger than the served model needs (at most "
                f"{max_header}: {HEADER_MARGIN} times the served model's headers)",
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsRejected(label, f"{NOT_SAFETENSORS} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise WeightsRejected(label, "header is not a JSON object")
    tensors: dict[str, TensorSpec] = {}
    end_of_data = 0
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        spec, (begin, end) = _entry(label, tensor, entry)
        end_of_data = max(end_of_data, end)
        tensors[tensor] = spec
        if end - begin != math.prod(spec.shape) * DTYPE_BYTES[spec.dtype]:
            raise WeightsRejected(
                label, f"tensor {tensor}: {end - begin} bytes do not hold {spec.describe()}"
            )
    data = size - 8 - length
    if end_of_data != data:
        raise WeightsRejected(
            label,
            f"the header describes {end_of_data} bytes of tensor data but the file holds {data} "
            "(truncated or padded)",
        )
    return tensors


def _entry(label: str, tensor: str, entry: object) -> tuple[TensorSpec, tuple[int, int]]:
    if not isinstance(entry, dict):
        raise WeightsRejected(label, f"tensor {tensor}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise WeightsRejected(label, f"tensor {tensor}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WeightsRejected(label, f"tensor {tensor}: shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise WeightsRejected(label, f"tensor {tensor}: data_offsets {offsets!r} are invalid")
    return TensorSpec(str(dtype), tuple(shape)), (offsets[0], offsets[1])


@dataclass(frozen=True)
class ModelLayout:
    """Every tensor of the served model, from the safetensors headers of its directory."""

    tensors: Mapping[str, TensorSpec]
    source: str
    header_bytes: int = 0
    """The served files' JSON headers together: what the headers of new weights are capped by."""

    @classmethod
    def of_directory(cls, model_dir: Path) -> ModelLayout:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir} holds no *.safetensors files")
        tensors: dict[str, TensorSpec] = {}
        header_bytes = 0
        for path in files:
            tensors.update(read_header(path))
            with path.open("rb") as f:
                header_bytes += struct.unpack("<Q", f.read(8))[0]
        return cls(tensors, str(model_dir), header_bytes)

    @property
    def max_header(self) -> int:
        return min(MAX_HEADER_BYTES, max(HEADER_FLOOR, HEADER_MARGIN * self.header_bytes))

    def check(self, files: Mapping[str, Path]) -> None:
        """Refuses ``files`` (name -> staged path) unless together they hold every tensor of the
        served model exactly once, each with its shape and dtype."""
        seen: dict[str, str] = {}
        for name, path in sorted(files.items()):
            for tensor, spec in read_header(path, name, max_header=self.max_header).items():
                served = self.tensors.get(tensor)
                if served is None:
                    raise WeightsRejected(
                        name, f"tensor {tensor} is not a tensor of the served model"
                    )
                if spec != served:
                    raise WeightsRejected(
                        name,
                        f"tensor {tensor} is {spec.describe()}, the served model's is "
                        f"{served.describe()}",
                    )
                if tensor in seen:
                    raise WeightsRejected(name, f"tensor {tensor} is also in {seen[tensor]}")
                seen[tensor] = name
        missing = sorted(set(self.tensors) - set(seen))
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise WeightsRejected(
                "weights", f"{len(missing)} tensors of the served model are missing: {shown}"
            )


def weights_file(path: Path, directory: Path, what: str = NOT_SAFETENSORS) -> Path:
    """``path`` (a file of ``directory``), refused unless it is a regular file that stays in
    ``directory``: a symlink elsewhere (``/etc/passwd``), a FIFO or a device would have the
    service read, or block on, a file nobody meant as weights."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(directory)):
        raise WeightsRejected(path.name, what)
    try:
        mode = real.stat().st_mode
    except FileNotFoundError:
        raise WeightsRejected(path.name, what) from None
    if not stat.S_ISREG(mode):
        raise WeightsRejected(path.name, what)
    return path


def check_headers(files: Mapping[str, Path]) -> None:
    """Without a served model to compare with: each file must at least be well-formed."""
    for name, path in sorted(files.items()):
        read_header(path, name)


def served_layout(model_dir: Path | None) -> ModelLayout | None:
    """The layout new weights are checked against, or None when the served model's tensors are
    unknown (the synthetic engine without a model, a model stored as ``*.bin``): new weights are
    then only checked to be well-formed safetensors files."""
    if model_dir is None:
        return None
    if not any(model_dir.glob("*.safetensors")):
        logger.warning(
            "%s holds no *.safetensors files: new weights cannot be checked against its tensors",
            model_dir,
        )
        return None
    return ModelLayout.of_directory(model_dir)
