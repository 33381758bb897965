"""Files that must never be seen half-written, and where moe-batch keeps what outlives a run.

Atomic writes: every output a later rule (or a resumed job) reads is written under a temporary
name beside its final path and renamed into place, so a killed job leaves either the old file
or the new one, never a torn one. The temporary name carries the process id, so two writers of
the same path never clobber each other's half-written file.

Locks: a file several jobs may update or build at once (a shared cache entry) is changed under
an exclusive advisory lock beside it.

Cache dirs: hardware profiles (keyed by machine fingerprint) and routing profiles of read-only
model directories, shared by every run and checkout on the machine.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | os.PathLike, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it onto `path`, on error remove
    it. Works for a file or a directory (a directory must not exist at `path` yet, or it is
    replaced whole).

    keep_existing: for content that is a pure function of its inputs (a built-in checkpoint),
    whatever is at `path` already is an equal copy another writer finished first: it is kept
    and the temporary one discarded, so a reader of `path` never sees it deleted under it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if keep_existing and path.exists():
            _remove(tmp)
            return
        if tmp.is_dir() and path.is_dir():
            shutil.rmtree(path)
        try:
            tmp.replace(path)
        except OSError:
            # Renaming a directory onto a non-empty one fails: another writer won the race.
            if not (keep_existing and path.exists()):
                raise
            _remove(tmp)
    except BaseException:
        _remove(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


@contextmanager
def exclusive_lock(lock_path: str | os.PathLike) -> Iterator[None]:
    """An exclusive advisory lock (flock) on `lock_path` held for the block; released if the
    process dies."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def default_cache_dir() -> Path:
    """$MOE_BATCH_CACHE, else $XDG_CACHE_HOME/moe-batch, else ~/.cache/moe-batch."""
    env = os.environ.get("MOE_BATCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-batch"


def hardware_cache_dir() -> Path:
    """Hardware profiles, one `<machine fingerprint>.yaml` each (`hardware.profile=auto`)."""
    return default_cache_dir() / "hardware"
