"""The cache folder every part of specdecode writes into (SPECDECODE_CACHE, default ~/.cache/specdecode), and
writing into it safely from several processes: a lock per name, and files that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))


@contextlib.contextmanager
def cache_lock(name: str):
    """Hold an exclusive lock shared by every process using this cache (two commands, or test workers, started on
    a fresh machine must not download or write the same file at once). Where the OS has no flock: no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path = cache_root() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def partial_path(path: Path) -> Path:
    """Where to write `path` before renaming it into place: per process, so concurrent writers never share one."""
    return path.with_name(f"{path.name}.{os.getpid()}.partial")


def write_text_atomic(path: Path, text: str) -> None:
    """Write a cache file so that a reader in another process sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    partial.write_text(text)
    os.replace(partial, path)
