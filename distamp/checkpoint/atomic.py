"""Files that appear whole or not at all: temporary file, fsync, rename, directory fsync.

A reader never sees a partial file under a final name, whatever point a
writer is killed at; what a killed writer leaves is a temporary file whose
name starts with :data:`TMP_PREFIX`, which the next save removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO, cast

__all__ = ["TMP_PREFIX", "fsync_dir", "sha256_of", "unlink", "write_atomically"]

TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


def fsync_dir(directory: str) -> None:
    """Make the renames in ``directory`` durable (POSIX: a rename lives in the directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms that cannot open directories
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the data files are synced
    finally:
        os.close(fd)


class _HashingWriter(io.RawIOBase):
    """A write-only file object that hashes what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            self._write_raw(view)
        except BaseException as exc:
            # torch's C++ writer replaces our exception with "unexpected pos";
            # keep it so the caller can report the real cause (e.g. disk full).
            self.error = exc
            raise
        self.sha256.update(view)
        self.size += view.nbytes
        return view.nbytes

    def _write_raw(self, view: memoryview) -> None:
        self._raw.write(view)

    def flush(self) -> None:
        self._raw.flush()


def write_atomically(
    directory: str,
    label: str,
    write: Callable[[BinaryIO], Any],
    final_name: Callable[[str], str],
) -> tuple[str, str, int]:
    """Write a file with ``write(fileobj)``, fsync it and rename it to ``final_name(sha256)``.

    ``label`` goes into the temporary file's name (for someone looking at
    the directory). The final name may depend on the content's SHA-256,
    which is known only once everything is written. Returns
    ``(final name, sha256 hex, size)``. On any failure the temporary file is
    removed and no final name is touched.
    """
    # pid and a random part: two writers (ranks, or a restarted job) never share a temporary.
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{label}")
    writer = None
    try:
        with open(tmp, "wb") as raw:
            writer = _HashingWriter(raw)
            write(cast(BinaryIO, writer))  # a binary file object to the writer, though not the typing class
            raw.flush()
            os.fsync(raw.fileno())
        sha = writer.sha256.hexdigest()
        name = final_name(sha)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException as exc:
        unlink(tmp)
        if writer is not None and writer.error is not None and writer.error is not exc:
            raise writer.error from exc
        raise
    fsync_dir(directory)
    return name, sha, writer.size


def sha256_of(path: str) -> tuple[str, int]:
    """``(sha256 hex, size)`` of the file at ``path``, read in 1 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def unlink(path: str) -> None:
    """Remove ``path``; a file that is already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
