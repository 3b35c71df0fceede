"""Reading and writing safetensors files with numpy, including bfloat16.

The official Qwen3-TTS checkpoints store the LM weights in bfloat16, which numpy has no dtype
for, so the ``safetensors`` package's numpy API cannot return them. This module reads the
format as specified (8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data) with a memory map,
and widens BF16 to float32 exactly (a bf16 value is the upper 16 bits of a float32).
Bundle tables are written with the ``safetensors`` package itself (F32/F16), which the Rust
``safetensors`` crate reads.

Errors: every malformed file raises :class:`herald_export.errors.ExportError` naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .errors import ExportError

#: safetensors dtype code -> (numpy storage dtype, element size in bytes).
_DTYPES = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "F64": (np.dtype("<f8"), 8),
}

#: Largest header the reader accepts (the format itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class SafetensorsFile:
    """A memory-mapped safetensors file: ``names()``, ``shape(name)``, ``dtype(name)``, ``get(name)``.

    ``get`` returns float32 for F32/F16/BF16 tensors (F16/BF16 are widened exactly) and the
    stored integer type otherwise.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ExportError(self.path, "not a safetensors file (shorter than its 8-byte header length)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    raise ExportError(self.path, f"not a safetensors file (header length {n} exceeds the file size {size})")
                raw = f.read(n)
        except OSError as e:
            raise ExportError(self.path, f"cannot read: {e.strerror or e}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise ExportError(self.path, f"not a safetensors file (bad JSON header: {e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dt = info["dtype"]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ExportError(self.path, f"tensor {name}: malformed header entry {info!r}") from None
            if dt not in _DTYPES:
                raise ExportError(self.path, f"tensor {name}: unsupported dtype {dt}")
            want = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dt][1]
            if end - begin != want or begin < 0 or end > data_len:
                raise ExportError(
                    self.path,
                    f"tensor {name}: data range {begin}..{end} does not hold {shape} {dt} "
                    f"within {data_len} data bytes (truncated file?)",
                )
            self._entries[name] = (dt, shape, begin, end)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else None

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> str:
        return self._entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (float32 for all float dtypes; a fresh array)."""
        dt, shape, begin, end = self._entries[name]
        storage, _ = _DTYPES[dt]
        buf = self._mm[self._data_start + begin : self._data_start + end]
        arr = np.frombuffer(buf, dtype=storage).reshape(shape)
        if dt == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        if dt in ("F16", "F64"):
            return arr.astype(np.float32)
        return np.array(arr)


def to_bf16_bits(arr: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (round-to-nearest-even) and return the raw uint16 bits."""
    a = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    rounding = ((a >> 16) & 1) + np.uint32(0x7FFF)
    return ((a + rounding) >> 16).astype(np.uint16)


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], bf16: set[str] | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format.

    Names listed in ``bf16`` are stored as BF16 (rounded from float32), the others in their
    own dtype (float32, float16, int64). Tensors are laid out in sorted name order, as the
    reference implementation does.
    """
    bf16 = bf16 or set()
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    code = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int64"): "I64", np.dtype("int32"): "I32"}
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if name in bf16:
            data, dt = to_bf16_bits(arr).tobytes(), "BF16"
        else:
            arr = np.ascontiguousarray(arr)
            data, dt = arr.astype(arr.dtype.newbyteorder("<")).tobytes(), code[arr.dtype]
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)
