"""Files that are either complete or absent: atomic writes, content hashes, and local paths that
are missing.

Every file a run relies on (checkpoints, ``stage.pt``, ``config.yaml``, ``done``,
``results.json``) is written to a temporary file in the same directory, flushed to disk, then
renamed over its final name: a crash, a full disk or a quota leaves the previous version (or no
file), never a truncated one. Plain Python; no lightning.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["WriteFailedError", "atomic_write", "atomic_write_bytes", "atomic_write_text",
           "file_digest", "follow_umask", "fsync_dir", "missing_local_path", "write_failed"]

#: errors that mean "the disk would not take it": the message says so
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class WriteFailedError(OSError):
    """A file could not be written completely (disk full, quota, file-size limit, permission);
    its previous version, if any, is intact and no partial file is left behind."""


def write_failed(path: str | os.PathLike, err: OSError, left: str) -> WriteFailedError:
    """The error for a write of ``path`` that failed with ``err``: what happened, why, what is
    left (``left``: "its previous version is intact", "nothing was left") and what to do."""
    if err.errno in _NO_SPACE:
        why = "the disk is full, a quota or a file-size limit was reached"
        todo = "free space (or fix the cause) and run again"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "the location is not writable"
        todo = "choose a writable location (or fix its permissions) and run again"
    else:
        why, todo = "the write failed", "fix the cause and run again"
    failed = WriteFailedError(f"could not write {str(path)!r} ({err.strerror or err}): {why}; "
                              f"{left} -- {todo}")
    failed.errno = err.errno
    return failed


def follow_umask(root: str | os.PathLike) -> None:
    """Give ``root`` and everything under it the modes the umask makes (0644 / 0755 under
    022): writers that go through a private temporary file (safetensors: 0600) or
    ``mkdtemp`` (0700) would otherwise leave files that colleagues on a shared cluster cannot
    read. Symbolic links are left alone."""
    umask = os.umask(0)
    os.umask(umask)
    root = Path(root)
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for p in paths:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse directory fds)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file; on a clean exit it is flushed, fsynced and renamed to ``path``.

    On any error the temporary file is removed and ``path`` keeps its previous content; an
    ``OSError`` becomes ``WriteFailedError`` naming ``path``."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(err, OSError) and not isinstance(err, WriteFailedError):
            raise write_failed(path, err, "its previous version is intact" if path.exists()
                               else "nothing was left") from err
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty sibling directory to fill; on a clean exit it replaces ``path`` (an existing
    directory or file is moved aside first, then removed), on an error it is removed and
    ``path`` is left as it was. The directory and its files follow the umask
    (``follow_umask``)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        follow_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
    tmp.rename(final)
    if old is not None and old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:
        old.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_write(path) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def file_digest(path: str | os.PathLike, chunk: int = 1 << 22,
                progress: Callable[[int], None] | None = None) -> str:
    """``sha256:<hex>`` of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return f"sha256:{h.hexdigest()}"


#: suffixes that only a local file has (a hub id has none)
_LOCAL_SUFFIXES = (".pt", ".ckpt", ".safetensors", ".json", ".yaml", ".yml", ".parquet",
                   ".jsonl", ".txt")


def missing_local_path(name: str) -> str | None:
    """A message when ``name`` can only mean a local path and nothing is there; ``None`` when it
    exists or may be a hub id. A hub id is ``name`` or ``org/name``; ``runs/x`` counts as local
    when ``runs/`` exists here, so a mistyped run is not tried on the hub (five retries, then a
    long traceback)."""
    p = Path(name).expanduser()
    if p.exists():
        return None
    first = Path(name).parts[0] if Path(name).parts else ""
    local = (name.startswith(("/", "./", "../", "~")) or name.count("/") >= 2
             or name.endswith(_LOCAL_SUFFIXES)
             or (name.count("/") == 1 and Path(first).expanduser().is_dir()))
    if not local:
        return None
    parent = next((q for q in p.parents if q.exists()), None)
    where = f" (the nearest existing directory is {str(parent)!r})" if parent not in (
        None, Path("."), Path("/")) else ""
    return f"{name!r} does not exist: no such file or directory{where}"
