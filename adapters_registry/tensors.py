"""Reading a safetensors header without trusting it: names, dtypes, shapes, and byte bounds.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the end of the header),
then the data. Parsing the header ourselves lets us check every offset against the real file size
(a truncated download is caught here, before vLLM mmaps the file) and never load tensor data.
The header is bounded before it is parsed (its length, its entries' count) and parsed entry by
entry (`json_values`); errors quote its values through `excerpt`, never whole.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters_registry.json_values import excerpt, is_int, parse_object_entrywise

# A header is names and shapes: 100 MiB is far beyond any adapter (a 30-layer rank-64 adapter
# on every projection has a 60 KiB header) and keeps a hostile length from allocating gigabytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# PEFT's longest names (a per-expert MoE module's factor) are about 100 characters.
MAX_NAME_CHARS = 256
MAX_DIMS = 8  # LoRA factors are 2D, fused-expert ones 3D

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class HeaderError(ValueError):
    """The file is not a well-formed, complete safetensors file; the message says where."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    span: tuple[int, int]  # its bytes [begin, end) in the file (checked against the file's size)


def read_header(
    path: Path, *, max_tensors: int | None = None, max_header_bytes: int = MAX_HEADER_BYTES
) -> dict[str, TensorInfo]:
    """Every tensor's name, dtype and shape; raises HeaderError if any byte range is wrong, or
    the header is longer than `max_header_bytes` or lists more than `max_tensors` tensors."""
    file_size = path.stat().st_size
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise HeaderError(f"{path.name} is {file_size} bytes: too short to be safetensors")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > max_header_bytes:
            raise HeaderError(
                f"{path.name}: header of {header_len} bytes exceeds the limit of "
                f"{max_header_bytes} bytes"
            )
        if 8 + header_len > file_size:
            raise HeaderError(
                f"{path.name} is truncated: its header needs {8 + header_len} bytes but the file "
                f"holds {file_size}"
            )
        raw = f.read(header_len)
    header = _parse(path.name, raw, max_tensors)
    data_size = file_size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            _check_metadata(path.name, meta)
            continue
        if len(name) > MAX_NAME_CHARS:
            raise HeaderError(
                f"{path.name}: a tensor name of {len(name)} characters ({excerpt(name)}) exceeds "
                f"{MAX_NAME_CHARS}"
            )
        tensors[name], begin, end = _check_entry(path.name, name, meta, data_size, 8 + header_len)
        spans.append((begin, end, name))
    _check_layout(path.name, spans, data_size)
    return tensors


def _parse(file: str, raw: bytes, max_tensors: int | None) -> dict[str, object]:
    def too_many(_: int) -> HeaderError:
        return HeaderError(f"{file}: header lists more than {max_tensors} tensors")

    entries = max_tensors + 1 if max_tensors is not None else len(raw)  # + __metadata__
    try:
        return parse_object_entrywise(raw.decode("utf-8"), entries, too_many)
    except HeaderError:
        raise
    except (ValueError, RecursionError) as e:
        # UnicodeDecodeError and JSONDecodeError are ValueErrors; RecursionError: nesting deeper
        # than the parser's stack ("[" x 200,000). The message says where, never what: the
        # bytes may be any file's.
        raise HeaderError(f"{file}: header is not valid JSON ({e})") from e


def _check_metadata(file: str, meta: object) -> None:
    """safetensors (and so vLLM's load) reads `__metadata__` as a map of strings to strings."""
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise HeaderError(f"{file}: __metadata__ must map strings to strings, got {excerpt(meta)}")


def _check_layout(file: str, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors must tile the data exactly, in offset order, as the safetensors library
    requires when vLLM loads the file: a gap, an overlap or trailing bytes pass the per-tensor
    bounds check but fail the load."""
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else "leaves a gap before it"
            raise HeaderError(
                f"{file}: tensor `{name}` starts at data byte {begin}, expected {at}: it {what}"
            )
        at = end
    if at != data_size:
        raise HeaderError(
            f"{file}: its tensors end at data byte {at} but the file holds {data_size} data "
            "bytes (trailing bytes)"
        )


def _check_entry(
    file: str, name: str, meta: object, data_size: int, data_start: int
) -> tuple[TensorInfo, int, int]:
    """The tensor's info and its byte range [begin, end) in the data."""
    if not isinstance(meta, dict):
        raise HeaderError(f"{file}: entry for tensor `{name}` is not an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise HeaderError(f"{file}: tensor `{name}` has unknown dtype {excerpt(dtype)}")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(is_int(d) and d >= 0 for d in shape)
    ):
        raise HeaderError(
            f"{file}: tensor `{name}` has invalid shape {excerpt(shape)} (at most {MAX_DIMS} "
            "non-negative integer dimensions)"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise HeaderError(f"{file}: tensor `{name}` has invalid data_offsets {excerpt(offsets)}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_BYTES[dtype]  # < 2^(64 * MAX_DIMS + 3): cheap, printable
    if not 0 <= begin <= end or end - begin != expected:
        raise HeaderError(
            f"{file}: tensor `{name}` spans bytes {begin}..{end} but its shape "
            f"{excerpt(shape)} of {dtype} needs {excerpt(expected)}"
        )
    if end > data_size:
        raise HeaderError(
            f"{file} is truncated: tensor `{name}` ends at data byte {end} but the file holds "
            f"{data_size} data bytes"
        )
    span = (data_start + begin, data_start + end)
    return TensorInfo(name, dtype, tuple(shape), span), begin, end
