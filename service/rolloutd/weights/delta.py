"""Weight deltas: what changed between two versions of the weights, checkable tensor by tensor.

Between two RL steps almost every bf16 weight is bit-identical, so a delta moves a few percent
of a full copy. The format (``docs/operations.md`` describes it byte by byte, so that any
language can read or write it) is one file::

    magic      8 bytes   b"RWDELTA1"
    length     8 bytes   little-endian unsigned: bytes of the JSON header
    header     length    UTF-8 JSON: base_version, version, and one entry per tensor
    payloads   the rest  one zstd frame per tensor with changes, back to back

Each tensor is stored in whichever encoding is smaller once compressed:

- ``xor``: the new bit pattern XOR the base's, byte for byte (mostly zero bytes, which compress
  to almost nothing);
- ``values``: the flat indices of the changed elements (as gaps from the previous index) and their
  new values. Applying it twice gives the same result (it overwrites).

A tensor without changes has encoding ``values``, ``changed`` 0 and no payload. Every entry
carries the SHA-256 of the tensor it must produce, so a delta applied to other weights than its
base, or a corrupt one, is caught tensor by tensor before the result is used.

What must hold when applying (:func:`apply_delta`): the delta names every tensor of the base, each
with the base's dtype and shape; every payload decodes to exactly what its entry declares; every
resulting tensor has its declared checksum. Anything else is refused with the tensor it concerns,
and nothing is written where the engine could read it.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import zstandard

from rolloutd.weights.layout import DTYPE_BYTES, MAX_HEADER_BYTES, TensorSpec, WeightsRejected

MAGIC = b"RWDELTA1"
FORMAT = "rolloutd.weights.delta"
FORMAT_VERSION = 1
SUFFIX = ".delta"
"""File name ending of a delta, in a push and in the weights store."""

XOR = "xor"
VALUES = "values"
ZSTD_LEVEL = 3

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SHA256_HEX = 64


@dataclass(frozen=True)
class DeltaEntry:
    """One tensor of a delta, as its header declares it."""

    name: str
    spec: TensorSpec
    encoding: str
    changed: int
    """Elements whose bit pattern differs from the base's."""
    begin: int
    end: int
    """Byte range of the payload within the payload section."""
    sha256: str
    """Of the resulting tensor's bytes (little-endian, as in a safetensors file)."""

    @property
    def numel(self) -> int:
        return math.prod(self.spec.shape)

    @property
    def index_dtype(self) -> type[np.unsignedinteger[Any]]:
        return np.uint32 if self.numel <= 2**32 else np.uint64


@dataclass(frozen=True)
class DeltaHeader:
    base_version: int
    version: int
    entries: Mapping[str, DeltaEntry]
    data_start: int
    """File offset of the payload section."""

    @property
    def elements(self) -> int:
        return sum(e.numel for e in self.entries.values())

    @property
    def changed(self) -> int:
        return sum(e.changed for e in self.entries.values())

    @property
    def density(self) -> float:
        """Fraction of elements that changed."""
        return self.changed / self.elements if self.elements else 0.0


@dataclass(frozen=True)
class DeltaStats:
    """What a delta holds, for the trainer that made it (and the benchmark)."""

    base_version: int
    version: int
    bytes: int
    """Size of the delta file."""
    full_bytes: int
    """Bytes of tensor data a full copy of the new weights would move."""
    elements: int
    changed: int
    tensors_changed: int
    encodings: Mapping[str, int] = field(default_factory=dict)
    """Tensors with changes, by encoding."""

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def bit_identical_fraction(self) -> float:
        return 1.0 - self.density


@dataclass(frozen=True)
class Applied:
    """A delta applied to the served weights: the new files, and which tensors differ."""

    header: DeltaHeader
    changed_tensors: tuple[str, ...]


# -- tensors as raw bytes ----------------------------------------------------------------------


@dataclass(frozen=True)
class RawTensor:
    """A tensor as a safetensors file holds it: dtype, shape and little-endian bytes."""

    spec: TensorSpec
    data: memoryview
    offset: int = 0
    """Where the bytes start in their safetensors file (when read from one)."""

    def elements(self) -> np.ndarray[Any, Any]:
        """The bit patterns, one unsigned integer per element."""
        width = DTYPE_BYTES[self.spec.dtype]
        return np.frombuffer(self.data, dtype=np.dtype(_UINT[width]).newbyteorder("<"))


_TORCH_DTYPES = {
    "torch.bool": "BOOL", "torch.uint8": "U8", "torch.int8": "I8",
    "torch.float8_e5m2": "F8_E5M2", "torch.float8_e4m3fn": "F8_E4M3",
    "torch.int16": "I16", "torch.uint16": "U16", "torch.float16": "F16",
    "torch.bfloat16": "BF16", "torch.int32": "I32", "torch.uint32": "U32",
    "torch.float32": "F32", "torch.int64": "I64", "torch.uint64": "U64", "torch.float64": "F64",
}  # fmt: skip
_NUMPY_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "float16": "F16", "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64",
    "uint64": "U64", "float64": "F64",
}  # fmt: skip


def raw_tensor(value: Any) -> RawTensor:
    """A torch tensor (any device; bf16 included) or a numpy array as raw bytes."""
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        dtype = _NUMPY_DTYPES[str(array.dtype)]
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return RawTensor(TensorSpec(dtype, tuple(array.shape)), _bytes_of(array))
    import torch  # only a trainer's state dict brings torch here

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch tensor or a numpy array, got {type(value).__name__}")
    tensor = value.detach().to("cpu").contiguous()
    dtype = _TORCH_DTYPES[str(tensor.dtype)]
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    return RawTensor(TensorSpec(dtype, tuple(tensor.shape)), _bytes_of(data))


def _bytes_of(array: np.ndarray[Any, Any]) -> memoryview:
    """A view of a contiguous array's bytes."""
    return array.reshape(-1).view(np.uint8).data


def read_safetensors(directory: Path) -> Iterator[tuple[str, Path, dict[str, RawTensor]]]:
    """Every ``*.safetensors`` file of ``directory``: its name, path and tensors (views of the
    mapped file, in header order)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsRejected("weights", f"{directory} holds no *.safetensors files")
    for path in files:
        with path.open("rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        yield path.name, path, _tensors_of(path.name, memoryview(mapped))


def _tensors_of(label: str, data: memoryview) -> dict[str, RawTensor]:
    header, start = _json_header(label, data, prefix=b"")
    tensors: dict[str, RawTensor] = {}
    for name, entry in sorted(
        ((n, e) for n, e in header.items() if n != "__metadata__"),
        key=lambda item: item[1]["data_offsets"][0],
    ):
        spec = TensorSpec(entry["dtype"], tuple(entry["shape"]))
        begin, end = entry["data_offsets"]
        tensors[name] = RawTensor(spec, data[start + begin : start + end], start + begin)
    return tensors


def _json_header(label: str, data: memoryview, *, prefix: bytes) -> tuple[dict[str, Any], int]:
    """The JSON header after ``prefix`` and an 8-byte length, and where the data after it starts."""
    size = len(data)
    at = len(prefix)
    if size < at + 8 or bytes(data[:at]) != prefix:
        raise WeightsRejected(label, f"is not a {'delta' if prefix else 'safetensors'} file")
    (length,) = struct.unpack("<Q", data[at : at + 8])
    if length > MAX_HEADER_BYTES or at + 8 + length > size:
        raise WeightsRejected(label, f"header length {length} does not fit a file of {size} bytes")
    try:
        header = json.loads(bytes(data[at + 8 : at + 8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsRejected(label, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsRejected(label, "header is not a JSON object")
    return header, at + 8 + length


# -- making a delta ----------------------------------------------------------------------------


def _as_raw(weights: Mapping[str, Any] | Path) -> dict[str, RawTensor]:
    if isinstance(weights, Path):
        out: dict[str, RawTensor] = {}
        for _, _, tensors in read_safetensors(weights):
            out.update(tensors)
        return out
    return {name: raw_tensor(value) for name, value in weights.items()}


def make_delta(
    base: Mapping[str, Any] | str | os.PathLike[str],
    new: Mapping[str, Any] | str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    base_version: int,
    version: int,
    level: int = ZSTD_LEVEL,
) -> DeltaStats:
    """Writes to ``out`` the delta that turns ``base`` (served as ``base_version``) into ``new``
    (to be served as ``version``). Each is a state dict (torch tensors or numpy arrays) or a
    directory of safetensors files; both must hold the same tensors with the same dtypes and
    shapes (a delta changes values, never the model)."""
    if version <= base_version:
        raise ValueError(f"version {version} must be greater than base_version {base_version}")
    old = _as_raw(base if isinstance(base, Mapping) else Path(base))
    now = _as_raw(new if isinstance(new, Mapping) else Path(new))
    if set(old) != set(now):
        differ = sorted(set(old) ^ set(now))
        raise ValueError(f"base and new weights hold different tensors: {', '.join(differ[:5])}")
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    entries: dict[str, dict[str, Any]] = {}
    payloads: list[bytes] = []
    offset = changed_total = tensors_changed = full_bytes = 0
    encodings: dict[str, int] = {}
    for name in sorted(now):
        before, after = old[name], now[name]
        if before.spec != after.spec:
            raise ValueError(
                f"tensor {name} is {after.spec.describe()}, its base {before.spec.describe()}"
            )
        full_bytes += len(after.data)
        encoding, changed, payload = _encode(before, after, compressor)
        entries[name] = {
            "dtype": after.spec.dtype,
            "shape": list(after.spec.shape),
            "encoding": encoding,
            "changed": changed,
            "data_offsets": [offset, offset + len(payload)],
            "sha256": hashlib.sha256(after.data).hexdigest(),
        }
        payloads.append(payload)
        offset += len(payload)
        changed_total += changed
        if changed:
            tensors_changed += 1
            encodings[encoding] = encodings.get(encoding, 0) + 1
    header = json.dumps(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "base_version": base_version,
            "version": version,
            "tensors": entries,
        },
        separators=(",", ":"),
    ).encode()
    target = Path(out)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for payload in payloads:
            f.write(payload)
    os.replace(partial, target)
    return DeltaStats(
        base_version=base_version,
        version=version,
        bytes=target.stat().st_size,
        full_bytes=full_bytes,
        elements=sum(math.prod(t.spec.shape) for t in now.values()),
        changed=changed_total,
        tensors_changed=tensors_changed,
        encodings=encodings,
    )


def _encode(
    before: RawTensor, after: RawTensor, compressor: zstandard.ZstdCompressor
) -> tuple[str, int, bytes]:
    """The smaller of the two encodings of one tensor, compressed; no payload when unchanged."""
    old, new = before.elements(), after.elements()
    where = np.flatnonzero(old != new)
    if where.size == 0:
        return VALUES, 0, b""
    xor = compressor.compress(np.bitwise_xor(old, new).tobytes())
    index_dtype = np.uint32 if new.size <= 2**32 else np.uint64
    gaps = np.diff(where, prepend=0).astype(np.dtype(index_dtype).newbyteorder("<"))
    values = compressor.compress(gaps.tobytes() + new[where].tobytes())
    if len(values) <= len(xor):
        return VALUES, int(where.size), values
    return XOR, int(where.size), xor


# -- reading and applying ----------------------------------------------------------------------


def read_header(path: Path, label: str | None = None) -> DeltaHeader:
    """The header of the delta at ``path``, checked to be well-formed and to fit the file (a
    truncated delta is refused naming the first tensor whose payload is cut)."""
    label = label or path.name
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(16)
        if len(head) == 16 and head[:8] == MAGIC:
            (length,) = struct.unpack("<Q", head[8:16])
            head += f.read(min(length, MAX_HEADER_BYTES))
    header, start = _json_header(label, memoryview(head), prefix=MAGIC)
    if header.get("format") != FORMAT or header.get("format_version") != FORMAT_VERSION:
        raise WeightsRejected(
            label,
            f"format {header.get('format')!r} version {header.get('format_version')!r} is not "
            f"{FORMAT!r} version {FORMAT_VERSION}",
        )
    base_version, version = header.get("base_version"), header.get("version")
    if not isinstance(base_version, int) or not isinstance(version, int):
        raise WeightsRejected(label, "base_version and version must be integers")
    tensors = header.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise WeightsRejected(label, "the header lists no tensors")
    entries = {name: _entry(label, name, e) for name, e in tensors.items()}
    ordered = sorted(entries.values(), key=lambda e: e.begin)
    at = 0
    for e in ordered:
        if e.begin != at:
            raise WeightsRejected(label, f"tensor {e.name}: payload does not follow the previous")
        at = e.end
    data = size - start
    for e in ordered:
        if e.end > data:
            raise WeightsRejected(
                label,
                f"tensor {e.name}: payload ends at byte {e.end} of {data} (the delta is truncated)",
            )
    if at != data:
        raise WeightsRejected(label, f"{data - at} bytes follow the last payload")
    return DeltaHeader(base_version, version, entries, start)


def _entry(label: str, name: str, entry: Any) -> DeltaEntry:
    def bad(what: str) -> WeightsRejected:
        return WeightsRejected(label, f"tensor {name}: {what}")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} are invalid")
    encoding, changed, digest = entry.get("encoding"), entry.get("changed"), entry.get("sha256")
    if encoding not in (XOR, VALUES):
        raise bad(f"unknown encoding {encoding!r}")
    numel = math.prod(shape)
    if not isinstance(changed, int) or not 0 <= changed <= numel:
        raise bad(f"changed {changed!r} is not a count of elements")
    if (changed == 0) != (offsets[0] == offsets[1]):
        raise bad("a payload is there exactly when elements changed")
    if not isinstance(digest, str) or len(digest) != _SHA256_HEX:
        raise bad("sha256 must be 64 hexadecimal digits")
    return DeltaEntry(
        name, TensorSpec(dtype, tuple(shape)), encoding, changed, offsets[0], offsets[1], digest
    )


def check_base(header: DeltaHeader, label: str, base: Mapping[str, TensorSpec]) -> None:
    """Refuses a delta whose tensors are not exactly those of the base, with their specs."""
    for name, entry in sorted(header.entries.items()):
        spec = base.get(name)
        if spec is None:
            raise WeightsRejected(label, f"tensor {name} is not a tensor of the served model")
        if spec != entry.spec:
            raise WeightsRejected(
                label,
                f"tensor {name} is {entry.spec.describe()}, the served model's is "
                f"{spec.describe()}",
            )
    missing = sorted(set(base) - set(header.entries))
    if missing:
        raise WeightsRejected(
            label, f"{len(missing)} tensors of the served model are missing: {missing[0]} …"
        )


def apply_delta(path: Path, base_dir: Path, out_dir: Path, label: str | None = None) -> Applied:
    """Applies the delta at ``path`` to the safetensors files of ``base_dir``, writing files of
    the same names and layout to ``out_dir``, fsynced; refuses (naming the tensor) a payload that
    does not decode or a resulting tensor whose checksum differs from the declared one."""
    label = label or path.name
    header = read_header(path, label)
    base_files = list(read_safetensors(base_dir))
    check_base(
        header, label, {n: t.spec for _, _, tensors in base_files for n, t in tensors.items()}
    )
    decompressor = zstandard.ZstdDecompressor()
    changed: list[str] = []
    with path.open("rb") as f:
        for name, base_path, tensors in base_files:
            target = out_dir / name
            shutil.copyfile(base_path, target)
            fd = os.open(target, os.O_WRONLY)
            try:
                for tensor, raw in tensors.items():
                    entry = header.entries[tensor]
                    result = _apply(f, header.data_start, entry, raw, decompressor, label)
                    if hashlib.sha256(result).hexdigest() != entry.sha256:
                        raise WeightsRejected(
                            label,
                            f"tensor {tensor}: the result's SHA-256 is not the delta's (applied "
                            "to other weights than its base, or corrupt)",
                        )
                    if entry.changed:
                        changed.append(tensor)
                        os.pwrite(fd, result, raw.offset)
                os.fsync(fd)
            finally:
                os.close(fd)
    return Applied(header, tuple(changed))


def _apply(
    f: BinaryIO,
    data_start: int,
    entry: DeltaEntry,
    base: RawTensor,
    decompressor: zstandard.ZstdDecompressor,
    label: str,
) -> memoryview:
    """The resulting tensor's bytes (the base's, when nothing changed)."""
    if entry.changed == 0:
        return base.data
    f.seek(data_start + entry.begin)
    compressed = f.read(entry.end - entry.begin)
    width = DTYPE_BYTES[entry.spec.dtype]
    index_width = np.dtype(entry.index_dtype).itemsize
    expected = (
        entry.numel * width if entry.encoding == XOR else entry.changed * (index_width + width)
    )
    try:
        payload = decompressor.decompress(compressed, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise WeightsRejected(label, f"tensor {entry.name}: corrupt payload ({exc})") from None
    if len(payload) != expected:
        raise WeightsRejected(
            label, f"tensor {entry.name}: payload holds {len(payload)} bytes, {expected} expected"
        )
    elements = base.elements().copy()
    if entry.encoding == XOR:
        np.bitwise_xor(elements, np.frombuffer(payload, dtype=elements.dtype), out=elements)
    else:
        gaps = np.frombuffer(
            payload, dtype=np.dtype(entry.index_dtype).newbyteorder("<"), count=entry.changed
        )
        where = np.cumsum(gaps, dtype=np.uint64)
        if (entry.changed > 1 and not np.all(gaps[1:] > 0)) or int(where[-1]) >= entry.numel:
            raise WeightsRejected(
                label, f"tensor {entry.name}: changed indices are not increasing within the tensor"
            )
        values = np.frombuffer(payload, dtype=elements.dtype, offset=entry.changed * index_width)
        elements[where.astype(np.intp)] = values
    return _bytes_of(elements)
