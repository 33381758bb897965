"""Reads for the disk tier: byte ranges of files into page-aligned host memory, past the page cache.

A weight budget is only real if the bytes read from disk do not also stay in the kernel's page
cache (it would hold a second copy of every streamed expert, outside any budget the engine can
enforce, and it would make a second read look free). So reads use O_DIRECT: the file offset, the
length and the destination address must then be multiples of the device's logical block size
(`ALIGN` covers every common one). Ranges that are not aligned (tensors inside a checkpoint's
safetensors file) are read as their aligned superset into a bounce buffer and copied out. On a
file system without O_DIRECT (tmpfs) the reader falls back to ordinary reads and drops the range
from the page cache after each one (`posix_fadvise(DONTNEED)`); `mode` says which is in use.

Every read checks that the file is still the one the job opened (inode, size, mtime): a
checkpoint replaced or rewritten under a running job fails the read with an error naming the file
instead of feeding the model a mix of two checkpoints.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

ALIGN = 4096  # O_DIRECT alignment: a multiple of every logical block size in use (512, 4096)
_BOUNCE_BYTES = 8 << 20


class DiskReadError(OSError):
    """A read of the disk tier failed: the message names the file and the byte range."""


def align_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` at a page-aligned address (anonymous mmap), as O_DIRECT needs.
    The mapping lives as long as the tensor (torch keeps the buffer's owner alive)."""
    size = max(ALIGN, align_up(nbytes))
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]


def _writable_view(t: torch.Tensor, start: int, nbytes: int) -> memoryview:
    """The bytes [start, start + nbytes) of a contiguous uint8 tensor as a writable buffer."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr() + start)).cast("B")


@dataclass(frozen=True)
class FileIdentity:
    """What says a file is still the one that was opened."""

    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Extent:
    """`nbytes` bytes at `offset` of `path`, to land at byte `dst_offset` of the destination."""

    path: str
    offset: int
    nbytes: int
    dst_offset: int = 0


@dataclass(frozen=True)
class DiskRead:
    """What one disk packet moves: extents of files into one destination buffer."""

    extents: tuple[Extent, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.extents)

    def split(self, packet_bytes: int) -> list["DiskRead"]:
        """The same bytes as reads of at most `packet_bytes` each (a multiple of ALIGN, so the
        pieces of an aligned extent stay aligned)."""
        step = max(ALIGN, packet_bytes // ALIGN * ALIGN)
        out: list[DiskRead] = []
        for e in self.extents:
            for start in range(0, e.nbytes, step):
                n = min(step, e.nbytes - start)
                out.append(DiskRead((Extent(e.path, e.offset + start, n, e.dst_offset + start),)))
        return out


class _OpenFile:
    def __init__(self, path: str, direct: bool):
        self.path = path
        self.direct = False
        fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT
                    raise
        if fd < 0:
            fd = os.open(path, os.O_RDONLY)
        self.fd = fd
        self.identity = FileIdentity.of(os.fstat(fd))

    def close(self) -> None:
        os.close(self.fd)


class DirectReader:
    """Reads extents into host buffers, bypassing the page cache where the file system allows.

    Thread-safe: the disk tier's reader threads share one instance (one open file per path).
    `bytes_read` counts the bytes that reached a destination; `mode` is "o_direct" when every
    file opened so far bypasses the page cache, else "buffered+dontneed".
    """

    def __init__(self, direct: bool = True):
        self.want_direct = direct
        self._files: dict[str, _OpenFile] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # one bounce buffer per reader thread
        self.bytes_read = 0

    @property
    def mode(self) -> str:
        with self._lock:
            files = list(self._files.values())
        if self.want_direct and all(f.direct for f in files):
            return "o_direct"
        return "buffered+dontneed"

    def expect(self, path: str | os.PathLike, identity: FileIdentity) -> None:
        """Fail now unless `path` is the file recorded as `identity` (a file written earlier,
        whose identity was kept: its extents were computed from that version)."""
        f = self._open(str(path))
        if f.identity != identity:
            raise DiskReadError(errno.ESTALE, f"{path} changed since its layout was recorded "
                                f"({identity} then, {f.identity} now)")

    def _open(self, path: str) -> _OpenFile:
        with self._lock:
            f = self._files.get(path)
            if f is None:
                try:
                    f = _OpenFile(path, self.want_direct)
                except OSError as exc:
                    raise DiskReadError(exc.errno or errno.EIO,
                                        f"cannot open {path}: {exc.strerror or exc}") from exc
                self._files[path] = f
            return f

    def read_into(self, dst: torch.Tensor, read: DiskRead) -> None:
        """Fill `dst` (contiguous uint8) at each extent's dst_offset with the extent's bytes."""
        if dst.dtype != torch.uint8 or not dst.is_contiguous():
            raise ValueError("the destination of a disk read is a contiguous uint8 tensor")
        for e in read.extents:
            if e.dst_offset + e.nbytes > dst.numel():
                raise ValueError(f"extent of {e.nbytes} bytes at {e.dst_offset} overflows a "
                                 f"destination of {dst.numel()} bytes")
            f = self._open(e.path)
            self._check_unchanged(f)
            try:
                if f.direct and not _aligned(e.offset, e.nbytes, dst.data_ptr() + e.dst_offset):
                    self._read_bounced(f, dst, e)
                else:
                    self._pread_exact(f, _writable_view(dst, e.dst_offset, e.nbytes), e.offset)
                    if not f.direct:
                        os.posix_fadvise(f.fd, e.offset, e.nbytes, os.POSIX_FADV_DONTNEED)
            except DiskReadError:
                raise
            except OSError as exc:
                raise DiskReadError(exc.errno or errno.EIO,
                                    f"read of {e.path} bytes {e.offset}..{e.offset + e.nbytes} "
                                    f"failed: {exc.strerror or exc}") from exc
            with self._lock:
                self.bytes_read += e.nbytes

    def _check_unchanged(self, f: _OpenFile) -> None:
        try:
            now = FileIdentity.of(os.stat(f.path))
        except OSError as exc:
            raise DiskReadError(exc.errno or errno.ENOENT,
                                f"{f.path} disappeared while the job was reading it") from exc
        if now != f.identity:
            raise DiskReadError(errno.ESTALE, f"{f.path} changed while the job was reading it "
                                f"(size {f.identity.size} -> {now.size}, mtime changed: "
                                f"{f.identity.mtime_ns != now.mtime_ns}); rerun the job")

    @staticmethod
    def _pread_exact(f: _OpenFile, view: memoryview, offset: int) -> None:
        done = _pread_some(f, view, offset)
        if done < len(view):
            raise DiskReadError(errno.EIO, f"{f.path} ends at byte {offset + done}, before "
                                f"{offset + len(view)}: the file is truncated")

    def _read_bounced(self, f: _OpenFile, dst: torch.Tensor, e: Extent) -> None:
        """An unaligned extent through an aligned bounce buffer, ALIGN-sized pieces at a time."""
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = aligned_empty(_BOUNCE_BYTES)
        pos, end = e.offset, e.offset + e.nbytes
        while pos < end:
            base = pos // ALIGN * ALIGN
            span = min(_BOUNCE_BYTES, align_up(end) - base)
            got = _pread_some(f, _writable_view(bounce, 0, span), base)
            take = min(end, base + got) - pos
            if take <= 0:
                raise DiskReadError(errno.EIO, f"{f.path} ends at byte {base + got}, before "
                                    f"{end}: the file is truncated")
            at = e.dst_offset + pos - e.offset
            dst[at:at + take].copy_(bounce[pos - base:pos - base + take])
            pos += take

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _pread_some(f: _OpenFile, view: memoryview, offset: int) -> int:
    """Read into all of `view` from `offset`, stopping early only at the end of the file;
    returns the bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(f.fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _aligned(*values: int) -> bool:
    return all(v % ALIGN == 0 for v in values)


def read_bytes(extents: Iterable[Extent], reader: Optional[DirectReader] = None) -> torch.Tensor:
    """The extents' bytes, concatenated in one new tensor (conversion passes, tests)."""
    extents = list(extents)
    total = sum(e.nbytes for e in extents)
    out = aligned_empty(total)
    placed, at = [], 0
    for e in extents:
        placed.append(Extent(e.path, e.offset, e.nbytes, at))
        at += e.nbytes
    own = reader is None
    reader = reader or DirectReader()
    try:
        reader.read_into(out, DiskRead(tuple(placed)))
    finally:
        if own:
            reader.close()
    return out


def sweep_read_rate(reads: Iterable[DiskRead], passes: int = 3,
                    direct: bool = True) -> float:
    """Bytes/s of reading `reads` back to back with the disk tier's reader, each into the same
    aligned buffer (at byte 0), median of `passes`: the rate a profile or benchmark quotes."""
    reads = list(reads)
    size = max((e.nbytes for r in reads for e in r.extents), default=ALIGN)
    buf = aligned_empty(size)
    at_zero = [DiskRead(tuple(Extent(e.path, e.offset, e.nbytes, 0) for e in r.extents))
               for r in reads]
    reader = DirectReader(direct)
    times = []
    try:
        for _ in range(passes):
            t0 = time.perf_counter()
            for r in at_zero:
                reader.read_into(buf, r)
            times.append(time.perf_counter() - t0)
    finally:
        reader.close()
    return sum(r.nbytes for r in reads) / statistics.median(times)


def file_identity(path: str | os.PathLike) -> FileIdentity:
    return FileIdentity.of(os.stat(Path(path)))
