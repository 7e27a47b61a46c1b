"""Packed weights kept on disk: the host kernels' layout of a model's matrices, packed once into
a file of the user's cache and mapped by every later load of the same model.

Why: packing writes as many fresh bytes as the model has, and fresh memory is what a load pays
for most where it is dear (a microVM whose host takes back freed guest pages pays ~2 ms a MB to
touch it again: 1.7 s for 800 MB, against 0.08 s on memory just freed). llama.cpp maps the GGUF
itself; a later load here maps the packed file: pages already in the page cache, shared by every
process that serves the model, mapped 2 MiB at a time, and nothing packed or requantized again.
The first load packs into anonymous memory in small pages (model/pack_region.py says why), and
a background thread writes the entry's file from it and then maps the file over it, so the model
serves from the page cache's 2 MiB mappings as every later load does, one copy in memory. Packing
straight into the file's mapped pages, as before, cost twice as much: each page of a sparse file
was zeroed through the filesystem's read path before being written, in fresh huge pages (1B
Q4_K_M shape, 680 MB packed, this 2-vCPU microVM: a 2.3-2.4 s load after 20 s idle).

An entry is `<key>.bin`, the arrays 4 KiB aligned, and `<key>.json`, what each served matrix is,
written last: after the data reached the disk (in a background thread, which a process exiting
first waits for: 0.3 s for the 1B Q6_K shape's 880 MB here), so an entry with an index is whole.
The key (the entry's file name) hashes the model's files (path, size, mtime, inode), the serving
format, and the source of the code that decides the layout, so changing any of them misses.
Matrices are recorded in the order the model asks for them with the formats and shapes they were
built from; a load that asks for something else stops using the entry (and packs the rest in
memory).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import mmap
import os
import threading
import uuid
from pathlib import Path

import numpy as np

from ember_cupy.half_weight import HalfWeight
from ember_cupy.model.pack_region import PackRegion
from ember_cupy.ops import _host
from ember_cupy.packed_weight import PackedWeight, StackedWeight, stack

logger = logging.getLogger("ember_cupy.weights")

ENV_VAR = "EMBER_WEIGHT_CACHE"                 # a directory, or "off"
DEFAULT_DIR = "~/.cache/ember-cupy/packed-weights"
MAX_ENTRIES = 4                                # the most recently used entries kept
ALIGN = 4096
PUBLISH_AT_EXIT_S = 60.0                       # the most an exiting process waits for its entry's fsync
FORMAT_VERSION = 1
_KINDS = {"PackedWeight": PackedWeight, "HalfWeight": HalfWeight}
_LAYOUT_SOURCES = ("packed_weight.py", "half_weight.py", "quant.py", "ops/pack.py", "model/weights.py",
                   "model/weight_cache.py")
_HOST_LAYOUT_SOURCES = ("pack.c", "matmul_16bit.c")


def cache_dir(setting: str) -> Path | None:
    """The directory `setting` names (EngineConfig.weight_cache: auto, off or a path), or None."""
    if setting == "auto":
        setting = os.environ.get(ENV_VAR, DEFAULT_DIR)
    if setting.strip().lower() in ("off", "none", "0", ""):
        return None
    return Path(os.path.expanduser(setting))


def _source_files(source: str) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return [path]


def entry_key(source: str, serving: str) -> str:
    """What an entry depends on: the model's files as they are now, how the model is served, and
    the code that lays the matrices out."""
    digest = hashlib.sha256(f"{FORMAT_VERSION}|{serving}".encode())
    for path in _source_files(source):
        st = path.stat()
        digest.update(f"|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}".encode())
    package = Path(__file__).resolve().parent.parent
    for name in _LAYOUT_SOURCES:
        digest.update((package / name).read_bytes())
    for name in _HOST_LAYOUT_SOURCES:
        digest.update((Path(_host.HOST_SOURCE_DIR) / name).read_bytes())
    return digest.hexdigest()[:32]


def size_bound(weights: dict) -> int:
    """Bytes the served matrices of `weights` (a checkpoint's) can take at most: 2 a weight (16-bit
    panels, the widest format served; rows padded to 16) and an alignment each: the size of the
    region packed into, whose untouched pages cost nothing but address space."""
    total = 0
    for weight in weights.values():
        for part in getattr(weight, "parts", (weight,)):
            shape = getattr(part, "shape", ())
            if len(shape) == 2:
                total += -(-shape[0] // 16) * 16 * shape[1] * 2 + ALIGN
    return total


def _signature(runs) -> list:
    """The formats and shapes a served matrix was built from."""
    return [[[part.qtype, list(part.shape)] for part in run] for run in runs]


def _parts(weight) -> list:
    return list(weight.parts) if isinstance(weight, StackedWeight) else [weight]


class WeightCache:
    """One model's entry: `served(runs, build)` gives each matrix, from the entry when it holds
    it (reading) or built by build(alloc) into the entry's file (writing); finish() when the model
    is built. Any OSError falls back to memory: the cache never fails a load."""

    def __init__(self, directory: Path, key: str):
        self.directory, self.key = directory, key
        self.data_path, self.index_path = directory / f"{key}.bin", directory / f"{key}.json"
        self._entries, self._position = [], 0
        self._map, self._file, self._reading, self._used = None, None, False, 0
        self._region: PackRegion | None = None     # where a new entry's matrices are packed
        self._publisher: threading.Thread | None = None

    @classmethod
    def open(cls, source: str, serving: str, setting: str, size_bound: int) -> WeightCache | None:
        """The entry for `source` served as `serving`: mapped when whole, else a new one of at most
        size_bound bytes being written; None when the cache is off or its directory unusable."""
        directory = cache_dir(setting)
        if directory is None:
            return None
        try:
            cache = cls(directory, entry_key(source, serving))
            if not cache._open_existing():
                directory.mkdir(parents=True, exist_ok=True)
                cache._start_writing(size_bound)
            return cache
        except OSError as error:
            logger.warning("weight cache %s unusable (%s): packing in memory", directory, error)
            return None

    @property
    def reading(self) -> bool:
        return self._reading

    def _open_existing(self) -> bool:
        try:
            index = json.loads(self.index_path.read_text())
            with open(self.data_path, "rb") as file:
                if os.fstat(file.fileno()).st_size != index["bytes"]:
                    return False
                self._map = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) if index["bytes"] else None
        except (OSError, ValueError, KeyError, TypeError):
            return False
        self._entries, self._reading = index["matrices"], True
        os.utime(self.index_path)   # most recently used
        return True

    def _start_writing(self, size_bound: int) -> None:
        self._remove_stale_files()
        # pid, then a token of this writer: two engines of one model in one process each write
        # their own file (sharing one truncated the file the first one's weights are mapped from)
        self._temp_path = self.directory / f"{self.key}.bin.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        self._file = open(self._temp_path, "w+b")
        self._region = PackRegion(max(size_bound, ALIGN))

    def served(self, runs, build):
        """The served matrix of `runs` (lists of QuantizedTensors of one format each)."""
        if self._reading:
            weight = self._read_next(_signature(runs))
            if weight is not None:
                return weight
            self._stop("the model asked for a matrix the entry does not hold next, or its record is damaged")
        if self._file is None:
            return build(np.empty)
        try:
            weight = build(self._alloc)
            self._entries.append({"runs": _signature(runs), "parts": [self._record(part) for part in _parts(weight)]})
        except _EntryFull:
            self._stop("a matrix did not fit the entry's size bound")
            return build(np.empty)
        return weight

    def _alloc(self, shape, dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        offset = -(-self._used // ALIGN) * ALIGN
        if offset + nbytes > self._region.bytes.nbytes:
            raise _EntryFull
        self._used = offset + nbytes
        return self._region.array(offset, shape, dtype)

    def _record(self, part) -> dict:
        part.data.flags.writeable = False   # the pages become the file's, mapped read-only
        offset = part.data.ctypes.data - self._region.bytes.ctypes.data
        if not 0 <= offset <= self._used - part.data.nbytes:
            raise _EntryFull    # not built in the entry's pages
        return {"kind": type(part).__name__, "qtype": part.qtype, "shape": list(part.shape), "offset": offset,
                "dtype": part.data.dtype.str, "array": list(part.data.shape)}

    def _read_next(self, signature: list):
        """The next recorded matrix if it was built from `signature`; None when it was not, or its
        record does not describe arrays inside the file (an index edited or damaged)."""
        try:
            entry = self._entries[self._position]
            if entry["runs"] != signature:
                return None
            parts = [_KINDS[p["kind"]](p["qtype"], self._view(p), tuple(p["shape"])) for p in entry["parts"]]
        except (IndexError, KeyError, TypeError, ValueError):
            return None
        self._position += 1
        return parts[0] if len(parts) == 1 else stack(parts)

    def _view(self, part: dict) -> np.ndarray:
        count = int(np.prod(part["array"]))
        if part["offset"] < 0 or count <= 0:
            raise ValueError("not an array of the file")
        return np.frombuffer(self._map, np.dtype(part["dtype"]), count, part["offset"]).reshape(part["array"])

    def _stop(self, why: str) -> None:
        logger.warning("weight cache entry %s: %s; packing the rest in memory", self.key, why)
        if self._file is not None:
            self._file.close()
            self._temp_path.unlink(missing_ok=True)
        self._reading, self._file = False, None

    def finish(self) -> None:
        """The model is built: a written entry is made durable and published in the background."""
        if self._reading and self._position != len(self._entries):
            logger.warning("weight cache entry %s holds matrices the model did not ask for", self.key)
        if self._file is None:
            return
        file, self._file = self._file, None
        index = {"bytes": self._used, "matrices": self._entries}
        self._publisher = threading.Thread(target=self._publish, args=(file, self._region, index),
                                           name="weight-cache", daemon=True)
        self._publisher.start()
        atexit.register(self.wait_published, PUBLISH_AT_EXIT_S)   # a short-lived process still leaves its entry

    def wait_published(self, timeout: float | None = None) -> None:
        """Until a written entry is on disk (tests and tools; serving never waits for it)."""
        if self._publisher is not None:
            self._publisher.join(timeout)

    def _publish(self, file, region: PackRegion, index: dict) -> None:
        """Write the region's bytes to the file, make them durable, serve from the file's pages,
        then publish the entry; at a low priority, as the model is already serving."""
        _lower_this_threads_priority()
        try:
            _write_all(file.fileno(), region.bytes[:index["bytes"]], 0)
            os.fsync(file.fileno())
            region.map_file(file.fileno(), index["bytes"])
            file.close()
            os.replace(self._temp_path, self.data_path)
            temp_index = self._temp_path.with_name(self._temp_path.name.replace(".bin.", ".json.", 1))
            with open(temp_index, "w") as out:
                json.dump(index, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp_index, self.index_path)
            self._evict()
        except OSError as error:
            logger.warning("weight cache entry %s not saved: %s", self.key, error)

    def _evict(self) -> None:
        """Keep the MAX_ENTRIES most recently used entries."""
        indexes = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for index in indexes[MAX_ENTRIES:]:
            index.unlink(missing_ok=True)
            index.with_suffix(".bin").unlink(missing_ok=True)

    def _remove_stale_files(self) -> None:
        """Temporary files of writers that are gone (a load that died before publishing)."""
        for path in self.directory.glob("*.tmp"):
            try:
                pid = int(path.name.split(".")[2])      # {key}.{bin|json}.{pid}[.{token}].tmp
                os.kill(pid, 0)
            except (ValueError, IndexError, ProcessLookupError):
                path.unlink(missing_ok=True)
            except PermissionError:
                pass   # another user's live process


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    """data (contiguous bytes) at offset of the file: one pwrite writes at most ~2 GiB."""
    view = memoryview(data)
    while len(view):
        count = os.pwrite(fd, view, offset)
        view, offset = view[count:], offset + count


def _lower_this_threads_priority() -> None:
    """Linux sets a nice value per thread: the copy and its fresh page-cache pages yield the CPU
    to the step thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class _EntryFull(Exception):
    pass

