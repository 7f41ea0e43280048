"""A GGUF file's header, read without unpacking its arrays: metadata, tensor infos, tensor data views.

    header = GGUFHeader(path)     ValueError (naming the byte) for a file that is not GGUF or is cut short
    header.value(key)             a metadata value: str, int, float, bool, or a list of them
    header.tensors                TensorInfo per tensor: name, dims (ggml order: fastest first), ggml
                                  type, data_offset (from the file's start), n_bytes
    header.data_start             where the tensor data begins: the header's length, padding included
    header.data(info)             the tensor's bytes as a numpy view of the memory map, typed and shaped
                                  as gguf's GGUFReader gives them (F32/F16/F64/I*: values in numpy order;
                                  other types: uint8 rows of whole blocks)

The format (llama.cpp's docs/gguf.md): "GGUF", a uint32 version (2 or 3), the tensor and key counts
(uint64), each key (a string: uint64 length and UTF-8 bytes) with a uint32 value type and its value
(an array: its element type, uint64 count, elements), then each tensor's name, dimension count and
dimensions, type and offset, and the data from the next multiple of general.alignment (32).

llama.cpp's own reader (gguf.GGUFReader) builds a numpy array for every element of every array:
Llama 3's 128,256 tokens and 280,147 merges became ~330 MB of small objects while a file was open,
~190 MB of which stayed resident after it was closed (a heap fragmented under the weights). Here an
array stays bytes in the map, found by walking its lengths, and is read only when asked for (the
server asks for none of the tokenizer's: a child process builds the tokenizer, runtime/gguf_tokenizer.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # value types that are not fixed-size scalars
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
DATA_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}  # types whose data gguf's reader types as values


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    qtype: int  # ggml type id
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class _Array:
    """An array value still in the map: `count` elements of `element_type` from byte `offset`."""
    element_type: int
    count: int
    offset: int


class _Cursor:
    """Reads the header's little-endian values in order, each checked against the file's end."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def _need(self, size: int) -> None:
        if self.pos + size > len(self.data):
            raise ValueError(f"cut short: {size} bytes needed at byte {self.pos} of {len(self.data)}")

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        self._need(size)
        text = bytes(self.data[self.pos:self.pos + size]).decode("utf-8")
        self.pos += size
        return text

    def value(self, value_type: int):
        """A value of `value_type` (an array left in the map as an _Array, its bytes walked over)."""
        if value_type in SCALARS:
            return self.scalar(SCALARS[value_type])
        if value_type == STRING:
            return self.string()
        if value_type != ARRAY:
            raise ValueError(f"unknown value type {value_type} at byte {self.pos}")
        element_type, count = self.scalar("<I"), self.scalar("<Q")
        array = _Array(element_type, count, self.pos)
        if element_type in SCALARS:
            size = count * struct.calcsize(SCALARS[element_type])
            self._need(size)
            self.pos += size
        else:
            for _ in range(count):
                self.skip(element_type)
        return array

    def skip(self, value_type: int) -> None:
        if value_type == STRING:  # the common case of a long walk (tokens, merges): no text made
            size = self.scalar("<Q")
            self._need(size)
            self.pos += size
        else:
            self.value(value_type)


class GGUFHeader:
    """A GGUF file's metadata and tensor infos (the memory map is kept for the tensors' data)."""

    def __init__(self, path: str | Path) -> None:
        self._map = np.memmap(path, dtype=np.uint8, mode="r")  # [file bytes]
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError("no GGUF magic at its start")
        cursor = _Cursor(memoryview(self._map))
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (this reader takes {VERSIONS}; "
                             "0 in the low half: a big-endian file, not read here)")
        tensor_count, key_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        self._values: dict[str, object] = {}
        for _ in range(key_count):
            key = cursor.string()
            self._values[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
            infos.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = self._values.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-cursor.pos // alignment) * alignment
        self.data_start = start  # the header's end: the tensor data's offsets count from here
        self.tensors = [self._info(name, dims, qtype, start + offset) for name, dims, qtype, offset in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    @staticmethod
    def _info(name: str, dims: tuple[int, ...], qtype: int, data_offset: int) -> TensorInfo:
        try:
            block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except ValueError:
            raise ValueError(f"tensor {name} has unknown ggml type {qtype}") from None
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block_values:
            raise ValueError(f"tensor {name}: rows of {dims[0]} are not whole blocks of {block_values}")
        return TensorInfo(name, dims, qtype, data_offset, elements // block_values * block_bytes)

    def has(self, key: str) -> bool:
        return key in self._values

    def value(self, key: str):
        """The metadata value under `key` (KeyError if absent); an array read from the map now, as a list."""
        value = self._values[key]
        return self._array(value) if isinstance(value, _Array) else value

    def _array(self, array: _Array) -> list:
        if array.element_type in SCALARS:
            dtype = np.dtype(SCALARS[array.element_type])
            return np.frombuffer(self._map, dtype=dtype, count=array.count, offset=array.offset).tolist()
        cursor = _Cursor(memoryview(self._map))
        cursor.pos = array.offset
        values = [cursor.value(array.element_type) for _ in range(array.count)]
        return [self._array(v) if isinstance(v, _Array) else v for v in values]

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes in the map (a view), typed and shaped as gguf's GGUFReader gives them."""
        raw = self._map[info.data_offset:info.data_offset + info.n_bytes]
        shape = tuple(reversed(info.dims))  # numpy order: the slowest dimension first
        dtype = DATA_DTYPES.get(GGMLQuantizationType(info.qtype).name)
        if dtype is not None:
            return raw.view(dtype).reshape(shape)
        block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
        return raw.reshape(*shape[:-1], shape[-1] // block_values * block_bytes) if shape else raw

    @property
    def size(self) -> int:
        return len(self._map)
