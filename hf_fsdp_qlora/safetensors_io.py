"""Streamed safetensors I/O: read one tensor at a time, write shards tensor by tensor.

A merge must never hold the model in memory. Reading goes through each tensor's byte range into a buffer
of its own (a memory map of the whole shard would count every touched page towards the resident set
until the shard is closed), and writing lays out a shard's header first, from the planned shapes, so
that each tensor's bytes can follow as soon as they are computed. Tensors that pass through unchanged
are copied file to file by the kernel (`copy_file_range`) and never enter Python at all.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_fsdp_qlora.errors import MergeError, MergeUsageError

__all__ = [
    "DTYPE_NAMES",
    "INDEX_NAME",
    "apply_umask_mode",
    "checkpoint_shards",
    "TORCH_DTYPES",
    "OrderedWorker",
    "ShardWriter",
    "TensorEntry",
    "parse_shard_size",
    "plan_shards",
    "read_header",
    "read_tensor",
    "umask_file_mode",
]


def umask_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file under this process's umask (0o644 under umask 022)."""
    try:  # Linux >= 4.7 reports it without changing it (os.umask can only be read by setting it)
        with open("/proc/self/status") as fh:
            mask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def apply_umask_mode(*paths) -> None:
    """Give files the permissions the user's umask gives: safetensors' ``save_file`` (0.8) creates its files 0600
    whatever the umask, so on a shared cluster the group could not read an adapter beside 0644 files."""
    mode = umask_file_mode()
    for path in paths:
        os.chmod(path, mode)


# safetensors dtype names <-> torch dtypes (the ones a transformers checkpoint can hold).
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself enforces
_COPY_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file: dtype name, shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    path: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


def _corrupted(path: Path, why: str) -> MergeError:
    return MergeError(
        f"{path} is not a valid safetensors file ({why}). The file is truncated or corrupted: "
        "save or download it again (compare its size with the original's)."
    )


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict]:
    """Parse and validate a safetensors header without reading any tensor data.

    Args:
        path: the `.safetensors` file.

    Returns:
        `(entries, metadata)`: entries by tensor name in file order, and the `__metadata__` dict.

    Raises:
        MergeError: the header is truncated, not JSON, names an unknown dtype, or points outside the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise _corrupted(path, f"{size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise _corrupted(path, f"header length {header_len} does not fit in a file of {size} bytes")
        raw = fh.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupted(path, f"header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise _corrupted(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise _corrupted(path, f"entry {name!r} lacks dtype, shape or data_offsets") from None
        if dtype not in TORCH_DTYPES:
            raise _corrupted(path, f"entry {name!r} has unsupported dtype {dtype!r}")
        numel = 1
        for dim in shape:
            numel *= dim
        if end - begin != numel * TORCH_DTYPES[dtype].itemsize or data_start + end > size or begin < 0:
            raise _corrupted(
                path,
                f"entry {name!r} has byte range [{begin}, {end}) that does not match its shape or the file size {size}",
            )
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, data_start + end, path))
    entries.sort(key=lambda e: e.start)  # file order, so a shard is read front to back
    return {e.name: e for e in entries}, metadata


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def checkpoint_shards(folder: Path) -> tuple[list[str], dict[str, str] | None] | None:
    """The shard files of a model saved with ``save_pretrained`` in `folder` and its index's weight map.

    Returns ``(files, weight_map)`` (``weight_map`` is ``None`` for a single ``model.safetensors``), or ``None``
    when the folder holds no safetensors checkpoint.

    Raises:
        MergeUsageError: the index is not JSON or has no ``weight_map`` of tensor name -> file.
        MergeError: the index lists no tensors.
    """
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise MergeUsageError(
                f"{index} is corrupted ({type(err).__name__}: {err}); save or download the model again"
            ) from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise MergeUsageError(
                f"{index}: weight_map is not an object of tensor name -> shard file "
                f"(found {type(weight_map).__name__}); save or download the model again"
            )
        if not weight_map:
            raise MergeError(
                f"{index} lists no tensors (empty weight_map): the model is incomplete; save or download it again"
            )
        return sorted(set(weight_map.values())), weight_map
    if (folder / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None
    return None


def read_tensor(fh, entry: TensorEntry, buf: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor from an open (binary, unbuffered is best) file into a CPU tensor.

    Args:
        fh: the open file.
        entry: where the tensor lies.
        buf: a uint8 CPU buffer of `entry.nbytes` to read into (reused across tensors); default: a new one.
    """
    if buf is None:
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    fh.seek(entry.start)
    got = 0
    while got < entry.nbytes:
        n = fh.readinto(view[got:])
        if not n:
            raise _corrupted(entry.path, f"file ends inside tensor {entry.name!r}")
        got += n
    return buf.view(entry.torch_dtype).reshape(entry.shape)


_WRITE_CHUNK = 1 << 17
_FLUSH_EVERY = 64 << 20


def _write_all(fd: int, data) -> None:
    # Page-sized-ish chunks, as cp writes: single writes of tens of MB can be several times slower than the same
    # bytes in 128 KiB writes (benchmarks/merge.py measures the write path).
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[:_WRITE_CHUNK])
        view = view[n:]


class ShardWriter:
    """Write one safetensors file whose tensors are known up front and whose bytes arrive one at a time.

    Args:
        path: the file to create (must not exist).
        layout: `(name, dtype_name, shape)` in the order the tensors will be written.
        metadata: the `__metadata__` strings.
    """

    def __init__(self, path: str | Path, layout: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]):
        self.path = Path(path)
        header: dict = {"__metadata__": metadata}
        self._pending: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in layout:
            numel = 1
            for dim in shape:
                numel *= dim
            nbytes = numel * TORCH_DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._pending.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        self.data_bytes = offset
        self._pending.reverse()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        _write_all(self._fd, struct.pack("<Q", len(raw)) + raw)
        self._end = self._flushed = 8 + len(raw)

    def _wrote(self, nbytes: int) -> None:
        # Start writing back every _FLUSH_EVERY bytes instead of letting dirty pages pile up until the kernel
        # throttles this writer and stalls the final fsync (benchmarks/merge.py shows the difference). DONTNEED
        # also keeps the output from evicting the base shards from the page cache. Durability still comes from the
        # fsync in close().
        self._end += nbytes
        if self._end - self._flushed >= _FLUSH_EVERY and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._flushed, self._end - self._flushed, os.POSIX_FADV_DONTNEED)
            self._flushed = self._end

    def _next(self, name: str, nbytes: int) -> None:
        expected, expected_bytes = self._pending.pop()
        if expected != name or expected_bytes != nbytes:  # a bug, not a user error: the layout must match
            raise RuntimeError(
                f"shard layout mismatch: expected {expected} ({expected_bytes} B), got {name} ({nbytes} B)"
            )

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor` (any device; copied to CPU) as the next planned entry."""
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._next(name, data.numel())
        _write_all(self._fd, data.numpy())
        self._wrote(data.numel())

    def copy_bytes(self, name: str, src_fd: int, offset: int, nbytes: int) -> None:
        """Append the next planned entry by copying `nbytes` at `offset` of `src_fd` (kernel copy when possible)."""
        self._next(name, nbytes)
        remaining = nbytes
        while remaining:
            try:
                n = os.copy_file_range(src_fd, self._fd, remaining, offset)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                n = self._copy_chunk(src_fd, offset, min(remaining, _COPY_CHUNK))
            if n == 0:
                raise MergeError(f"source file ended while copying tensor {name!r}: it is truncated, save it again")
            offset += n
            remaining -= n
        self._wrote(nbytes)

    def _copy_chunk(self, src_fd: int, offset: int, size: int) -> int:
        data = os.pread(src_fd, size, offset)
        _write_all(self._fd, data)
        return len(data)

    def close(self) -> None:
        """Check every planned tensor was written, flush to disk and close."""
        try:
            if self._pending:
                raise RuntimeError(f"{len(self._pending)} planned tensors were never written to {self.path}")
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without checks (the folder is about to be removed); does nothing once closed."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class OrderedWorker:
    """Runs submitted calls one after another on a background thread, so that writing one tensor to disk
    overlaps computing the next (file I/O and torch kernels both release the GIL).

    An exception in a call is raised again in the submitting thread by the next `submit`/`wait`; the calls
    after it are skipped.
    """

    def __init__(self, depth: int = 1):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._cleanups: list = []
        self._thread = threading.Thread(target=self._run, name="merge-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self._error is None:
                    fn, args = task
                    fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the submitting thread, raised there
                self._error = err
            finally:
                self._queue.task_done()

    def _check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def submit(self, fn, *args) -> None:
        self._check()
        self._queue.put((fn, args))

    def wait(self) -> None:
        """Block until every submitted call ran; raise the first error."""
        self._queue.join()
        self._check()

    def on_abort(self, fn) -> None:
        self._cleanups.append(fn)

    def abort(self) -> None:
        """Skip what is still queued, wait for the running call, then run the cleanups."""
        self._error = self._error or RuntimeError("aborted")
        self._queue.join()
        for fn in self._cleanups:
            fn()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_shard_size(size: int | str) -> int:
    """`"5GB"` -> 5_000_000_000 (decimal units like transformers; `GiB` etc. binary), ints pass through."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
        if not match:
            raise ValueError(f"cannot read size {size!r}: use a number with a unit, e.g. 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def plan_shards(items: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split `(name, nbytes)` in order into shards of at most `max_bytes` (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in items:
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards if shards[0] else []
