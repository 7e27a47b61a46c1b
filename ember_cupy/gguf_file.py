"""A GGUF file's metadata and tensor table, read in one pass (the format: llama.cpp's
docs/gguf.md, versions 2 and 3). gguf.GGUFReader builds a NumPy view per value, about a second
per 100k vocabulary strings; this reads the same values with struct and hands out each tensor's
bytes as a view of one read-only memmap."""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # GGUF order: innermost (contiguous) dimension first
    tensor_type: object         # gguf.GGMLQuantizationType
    data: np.ndarray            # uint8 view of the tensor's bytes in the file


class CutShort(Exception):
    """A read past the end of the file's bytes."""


class _Cursor:
    def __init__(self, buffer):
        self.buffer, self.offset = buffer, 0

    def _take(self, length: int) -> int:
        """The offset of the next `length` bytes, which must lie inside the buffer."""
        start = self.offset
        if length < 0 or start + length > len(self.buffer):
            raise CutShort
        self.offset = start + length
        return start

    def unpack(self, fmt: str):
        return struct.unpack_from(fmt, self.buffer, self._take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        start = self._take(length)
        return bytes(self.buffer[start:self.offset]).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary): one loop with no call per string."""
        buffer, offset, out = self.buffer, self.offset, []
        length_at, append, end = _LENGTH.unpack_from, out.append, len(self.buffer)
        for _ in range(count):
            if offset + 8 > end:
                raise CutShort
            length = length_at(buffer, offset)[0]
            offset += 8
            if offset + length > end:
                raise CutShort
            append(str(buffer[offset:offset + length], "utf-8", "replace"))
            offset += length
        self.offset = offset
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _NUMPY:           # numbers: one view, converted to a list as gguf does
                dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
                start = self._take(count * dtype.itemsize)
                return np.frombuffer(self.buffer, dtype, count, start).tolist()
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"GGUF metadata value of unknown type {kind}")
        return self.unpack(_SCALARS[kind])


class GGUFFile:
    """metadata: key -> decoded value; tensors: TensorInfo in file order."""

    def __init__(self, path: str):
        self.path = path
        if os.path.getsize(path) < len(_MAGIC):
            raise ValueError(f"{path} is not a GGUF file (it holds {os.path.getsize(path)} bytes)")
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        buffer = memoryview(self._map.view(np.ndarray))
        if bytes(buffer[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cursor = _Cursor(buffer)
        cursor.offset = 4
        try:
            infos = self._read_header(cursor)
        except CutShort:
            raise ValueError(f"{path}: the file ends inside its GGUF header ({len(buffer)} bytes): it is cut "
                             "short (an interrupted download?) or damaged") from None
        self._locate_tensors(infos, cursor.offset)

    def _read_header(self, cursor: _Cursor) -> list[tuple]:
        """The metadata (into self.metadata) and the tensor table: (name, dims, type, offset)s."""
        from gguf import GGMLQuantizationType
        path = self.path
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            kind = cursor.unpack("<I")
            if kind not in GGMLQuantizationType._value2member_map_:
                raise ValueError(f"{path}: tensor {name} has type {kind}, not a GGML type this gguf package knows")
            infos.append((name, dims, GGMLQuantizationType(kind), cursor.unpack("<Q")))
        return infos

    def _locate_tensors(self, infos: list[tuple], header_end: int) -> None:
        from gguf import GGML_QUANT_SIZES
        path = self.path
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-header_end // alignment) * alignment
        plain = self._map.view(np.ndarray)
        self.tensors = []
        for name, dims, kind, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            nbytes = int(np.prod(dims, dtype=np.int64)) // block * block_bytes
            if nbytes < 0 or start + offset + nbytes > len(plain):
                raise ValueError(f"{path}: tensor {name} lies beyond the end of the file ({len(plain)} bytes): "
                                 "it is cut short (an interrupted download?) or damaged")
            self.tensors.append(TensorInfo(name, dims, kind, plain[start + offset:start + offset + nbytes]))


def release_pages(array: np.ndarray) -> None:
    """Drop the pages of `array`, when it is a view of a read-only file map (a GGUF tensor), from
    this process's resident set: the page cache keeps them and a later read maps them again, so
    a matrix once packed does not stay resident beside its packed copy while the rest load. Any
    other array (a copy in anonymous memory, whose pages this would zero) is left alone."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if not isinstance(base, mmap.mmap) or array.size == 0 or not array.flags.c_contiguous:
        return
    map_start = np.frombuffer(base, np.uint8, 1).ctypes.data
    start = array.ctypes.data - map_start
    end = start + array.nbytes
    start -= start % mmap.PAGESIZE
    base.madvise(mmap.MADV_DONTNEED, start, end - start)
