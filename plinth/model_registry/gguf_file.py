"""A GGUF file's header (metadata and tensor table), parsed once per file and process.

GGUF (llama.cpp's format, version 2 and 3) is little-endian: the magic ``GGUF``, a ``u32`` version, a
``u64`` tensor count and a ``u64`` metadata count; then the metadata as (key, ``u32`` value type, value)
triples, strings as a ``u64`` length and UTF-8 bytes, arrays as a ``u32`` element type, a ``u64`` count
and the elements; then per tensor its name, ``u32`` dimension count, ``u64`` dimensions (innermost
first), ``u32`` ggml type and ``u64`` offset into the data section, which starts at the next multiple of
``general.alignment`` (32 by default).

This reader walks the header once with ``struct`` over a read-only memory map and builds plain Python
values (arrays of strings are decoded when first read), which takes a few hundredths of a second where ``gguf.GGUFReader`` (numpy views of every
token string) takes seconds. Tensor data stays in the map until a caller asks for it.

:func:`open_gguf` shares one parsed file per path within the process: the config, the tokenizer and
the weights of one start read the same header. A file that changed on disk (size, modification time or
inode) is parsed again.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import math
import mmap
import os
import re
import struct
import threading
from typing import Any

import numpy as np

from plinth.errors import ModelLoadError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # version 1 counted in 32 bits and is gone from the wild
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS

# metadata value type -> (struct format, numpy dtype) of the fixed-size ones; 8 is a string, 9 an array
_FIXED = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.dtype("<u2")), 3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")), 5: ("<i", np.dtype("<i4")), 6: ("<f", np.dtype("<f4")), 7: ("<?", np.bool_),
    10: ("<Q", np.dtype("<u8")), 11: ("<q", np.dtype("<i8")), 12: ("<d", np.dtype("<f8")),
}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# ggml types whose tensors hold plain values (gguf.GGUFReader's convention); all others are uint8 blocks
_VALUE_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 24: np.int8, 25: np.dtype("<i2"),
                 26: np.dtype("<i4"), 27: np.dtype("<i8"), 28: np.dtype("<f8")}


class _Truncated(Exception):
    """The header runs past the end of the file (internal; becomes a ModelLoadError)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the table: where its bytes are and how to view them."""

    name: str
    ggml_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as numpy/Hugging Face order it: outermost first
    offset: int  # absolute file offset of the first byte
    n_bytes: int
    part: int = 0  # which file of a split model holds it (0: the first, or the only one)

    @property
    def array_shape(self) -> tuple[int, ...]:
        """The shape of :meth:`GGUFFile.tensor_data`: ``shape`` for value types, else
        ``[*shape[:-1], bytes_per_row]`` uint8."""
        if int(self.ggml_type) in _VALUE_DTYPES:
            return self.shape
        rows = math.prod(self.shape[:-1])
        return (*self.shape[:-1], self.n_bytes // max(rows, 1))


class _Cursor:
    """Sequential little-endian reads from a buffer, raising _Truncated past its end."""

    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Truncated(f"needs {n} bytes at offset {start}, the file has {self.size}")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.need(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.need(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self.need(n)
        return self.buf[start:start + n].decode("utf-8")

    def strings(self, count: int) -> StringArray:
        """An array of ``count`` strings, walked past now (their lengths only) and decoded when first read."""
        start, pos, buf = self.pos, self.pos, self.buf
        unpack = _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
                if pos > self.size:
                    raise struct.error("past the end")
        except struct.error:
            raise _Truncated(f"an array of {count} strings at offset {start}") from None
        self.need(pos - start)
        return StringArray(buf, start, count)

    def value(self, kind: int) -> Any:
        if kind in _FIXED:
            fmt, _ = _FIXED[kind]
            return struct.unpack_from(fmt, self.buf, self.need(struct.calcsize(fmt)))[0]
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _FIXED:
                dtype = np.dtype(_FIXED[item][1])
                start = self.need(count * dtype.itemsize)
                return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
            if count * 8 > self.size - self.pos:  # every element takes at least 8 bytes
                raise _Truncated(f"an array of {count} elements at offset {self.pos}")
            if item == _STRING:
                return self.strings(count)
            if item == _ARRAY:   # nested arrays: no format key has them; refuse rather than recurse without end
                raise ValueError(f"an array of arrays at offset {self.pos} (not a GGUF metadata value plinth reads)")
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind} at offset {self.pos}")


class StringArray(collections.abc.Sequence):
    """A metadata array of strings (a tokenizer's 50k tokens and merges), decoded on first use: plinth itself
    never reads them (a tokenizer is converted by transformers from the file, or comes from plinth's cache).
    Compares equal to the list of its strings; slices are lists."""

    def __init__(self, buf: Any, start: int, count: int):
        self._buf, self._start, self._count = buf, start, count
        self._items: list[str] | None = None

    def _list(self) -> list[str]:
        if self._items is None:
            cur = _Cursor(self._buf, len(self._buf))
            cur.pos = self._start
            try:
                self._items = [cur.string() for _ in range(self._count)]
            except UnicodeDecodeError as e:
                raise ModelLoadError(f"a GGUF metadata array of strings is not UTF-8: {e}") from e
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __iter__(self) -> Any:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            other = other._list()
        return self._list() == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


@dataclasses.dataclass(eq=False)
class GGUFFile:
    """A parsed GGUF header and a read-only map of the file.

    Attributes:
        path: the path it was opened with.
        identity: ``(device, inode, size, mtime_ns)`` when parsed; a changed file has another.
        metadata: every key as a Python value (lists for arrays; arrays of strings as
            :class:`StringArray`, decoded when first read).
        tensors: the tensor table in file order.
    """

    path: str
    identity: tuple[int, int, int, int]
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    _map: Any = dataclasses.field(repr=False)
    #: the maps of a split model's later files (``GGUFTensorInfo.part`` 1, 2, ...)
    _parts: tuple[Any, ...] = dataclasses.field(default=(), repr=False)
    #: a split model's later files: ``(path, identity)`` each, as parsed
    part_files: tuple[tuple[str, tuple[int, int, int, int]], ...] = ()

    def parts_unchanged(self) -> bool:
        """Whether a split model's later files are still those parsed (always true of one file)."""
        return all(_identity(path) == identity for path, identity in self.part_files)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes, memory-mapped and read-only, as ``info.array_shape`` (see there)."""
        dtype = _VALUE_DTYPES.get(int(info.ggml_type), np.dtype(np.uint8))
        buf = self._map if info.part == 0 else self._parts[info.part - 1]
        flat = np.frombuffer(buf, dtype=dtype, count=info.n_bytes // dtype.itemsize, offset=info.offset)
        return flat.reshape(info.array_shape)

    @classmethod
    def parse(cls, path: str) -> GGUFFile:
        """Read the header of ``path``; of a split model (llama.cpp's ``gguf-split``: ``NAME-00001-of-0000N.gguf``
        and the files beside it), the first file's metadata and every file's tensors.

        Raises:
            ModelLoadError: the file is missing, not GGUF, of another version or byte order, truncated,
                corrupt; a split model's later file given instead of the first, a missing or mismatched part, or a
                tensor in two parts.
        """
        first = cls._parse_one(path)
        count = first.metadata.get("split.count", 1)
        if not isinstance(count, int) or count <= 1:
            return first
        return cls._joined(first, count)

    @classmethod
    def _joined(cls, first: GGUFFile, count: int) -> GGUFFile:
        """A split model's parts as one file: the metadata of the first, the tensors of all."""
        path = first.path
        m = _SPLIT_NAME.match(os.path.basename(path))
        if first.metadata.get("split.no", 0) != 0:
            name = (f"{m['stem']}-00001-of-{m['count']}.gguf" if m else "the first part")
            raise ModelLoadError(f"GGUF file {path!r} is part {first.metadata.get('split.no', 0) + 1} of a split "
                                 f"model of {count} files: give the first one ({name}), which names the others")
        if m is None or int(m["count"]) != count:
            raise ModelLoadError(f"GGUF file {path!r} is the first of a split model of {count} files, but its name is "
                                 f"not NAME-00001-of-{count:05d}.gguf, so the other parts cannot be found: keep "
                                 "llama.cpp's names (or merge the parts with gguf-split --merge)")
        tensors, maps, files = list(first.tensors), [], []
        names = {t.name for t in tensors}
        for i in range(1, count):
            ext = os.path.basename(path)[-5:]   # (".gguf" in the first file's case)
            part_path = os.path.join(os.path.dirname(path), f"{m['stem']}-{i + 1:05d}-of-{m['count']}{ext}")
            if not os.path.isfile(part_path):
                raise ModelLoadError(f"GGUF file {path!r} is split into {count} files, but part {i + 1} "
                                     f"({part_path!r}) is missing")
            part = cls._parse_one(part_path)
            if part.metadata.get("split.count") != count or part.metadata.get("split.no") != i:
                raise ModelLoadError(f"GGUF file {part_path!r} is not part {i + 1} of {count} of {path!r} (its "
                                     f"split.no is {part.metadata.get('split.no')!r}, split.count "
                                     f"{part.metadata.get('split.count')!r})")
            for t in part.tensors:
                if t.name in names:
                    raise ModelLoadError(f"GGUF split model {path!r}: tensor {t.name!r} is in two parts")
                names.add(t.name)
                tensors.append(dataclasses.replace(t, part=i))
            maps.append(part._map)
            files.append((part_path, part.identity))
        total = first.metadata.get("split.tensors.count")
        if isinstance(total, int) and total != len(tensors):
            raise ModelLoadError(f"GGUF split model {path!r}: its parts hold {len(tensors)} tensors, its first file "
                                 f"says {total}")
        return dataclasses.replace(first, tensors=tuple(tensors), _parts=tuple(maps), part_files=tuple(files))

    @classmethod
    def _parse_one(cls, path: str) -> GGUFFile:
        import gguf

        if not os.path.isfile(path):
            raise ModelLoadError(f"GGUF file {path!r} does not exist")
        with open(path, "rb") as f:
            if f.read(4) != _MAGIC:
                raise ModelLoadError(f"{path!r} is not a GGUF file: it does not start with the bytes {_MAGIC!r}")
            st = os.fstat(f.fileno())
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        cur = _Cursor(buf, st.st_size)
        try:
            cur.need(4)
            version = cur.u32()
            if version & 0xFFFF == 0:
                raise ModelLoadError(f"GGUF file {path!r} has the other byte order than this machine; convert it first")
            if version not in _VERSIONS:
                raise ModelLoadError(f"GGUF file {path!r} has version {version}; supported versions: 2, 3")
            n_tensors, n_kv = cur.u64(), cur.u64()
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                metadata[key] = cur.value(cur.u32())
            raw = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.u32()
                if n_dims > _MAX_DIMS:
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
                dims = [cur.u64() for _ in range(n_dims)]
                raw.append((name, dims, cur.u32(), cur.u64()))
            alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment!r} is not a power of two")
            data_start = -(-cur.pos // alignment) * alignment
            tensors = _tensor_table(raw, data_start, st.st_size, path, gguf)
        except ModelLoadError:
            raise
        except _Truncated as e:
            raise ModelLoadError(f"GGUF file {path!r} is truncated or corrupt: {e}") from e
        except (ValueError, UnicodeDecodeError, struct.error) as e:
            raise ModelLoadError(f"GGUF file {path!r} is corrupt: {e}") from e
        return cls(path, identity, version, metadata, tensors, buf)


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


#: the names llama.cpp's ``gguf-split`` gives a split model's files
_SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def _tensor_table(raw: list[tuple[str, list[int], int, int]], data_start: int, size: int, path: str,
                  gguf: Any) -> tuple[GGUFTensorInfo, ...]:
    tensors, seen = [], set()
    for name, dims, type_id, offset in raw:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError) as e:
            raise ValueError(f"tensor {name!r} has the unknown ggml type {type_id}") from e
        n_elements = math.prod(dims)   # Python integers: a product past 64 bits must not wrap
        if any(d < 1 for d in dims) or n_elements >= 1 << 48:
            raise ValueError(f"tensor {name!r} has the impossible dimensions {dims}")
        if dims and dims[0] % block_size:
            raise ValueError(f"tensor {name!r}: rows of {dims[0]} are not whole blocks of {block_size}")
        n_bytes = n_elements // block_size * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise ModelLoadError(f"GGUF file {path!r} is truncated: tensor {name!r} runs past its end")
        tensors.append(GGUFTensorInfo(name, ggml_type, tuple(reversed(dims)), start, n_bytes))
    return tuple(tensors)


class _SharedFiles:
    """Parsed files by real path, the most recently used few kept; a changed file is parsed again."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._files: collections.OrderedDict[str, GGUFFile] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str) -> GGUFFile:
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError:
            return GGUFFile.parse(path)  # says what is wrong with it
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:  # one parse per file even when threads ask at once
            parsed = self._files.get(real)
            if parsed is None or parsed.identity != identity or not parsed.parts_unchanged():
                parsed = GGUFFile.parse(path)
                self._files[real] = parsed
            self._files.move_to_end(real)
            while len(self._files) > self._capacity:
                self._files.popitem(last=False)
            return parsed

    def clear(self) -> None:
        with self._lock:
            self._files.clear()


_SHARED = _SharedFiles(capacity=4)


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of ``path``, shared by every caller in this process while the file is unchanged.

    Raises:
        ModelLoadError: see :meth:`GGUFFile.parse`.
    """
    return _SHARED.get(str(path))


def clear_gguf_cache() -> None:
    """Forget the shared parsed files (their maps close once no tensor view is left)."""
    _SHARED.clear()
