"""distamp.checkpoint.atomic: a file appears whole under its final name or not at all."""

from __future__ import annotations

import hashlib
import os

import pytest

from distamp.checkpoint import atomic


def test_write_atomically_names_the_file_after_its_hash_and_leaves_no_temporary(tmp_path):
    name, sha, size = atomic.write_atomically(
        str(tmp_path), "label", lambda f: f.write(b"hello"), lambda digest: f"file-{digest[:4]}"
    )
    assert sha == hashlib.sha256(b"hello").hexdigest()
    assert size == 5
    assert name == f"file-{sha[:4]}"
    assert os.listdir(tmp_path) == [name]
    assert (tmp_path / name).read_bytes() == b"hello"
    assert atomic.sha256_of(str(tmp_path / name)) == (sha, 5)


class _DiskFull(OSError):
    pass


def test_a_failed_write_removes_its_temporary_and_reports_the_writers_own_error(tmp_path, monkeypatch):
    (tmp_path / "final").write_bytes(b"old")

    def write(f):
        f.write(b"part")
        try:
            f.write(b"more")
        except _DiskFull:
            # torch.save swallows the cause and raises its own error; the writer kept it.
            raise RuntimeError("unexpected pos") from None

    real = atomic._HashingWriter._write_raw

    def fail_second(self, view):
        if self.size:
            raise _DiskFull(28, "No space left on device")
        real(self, view)

    monkeypatch.setattr(atomic._HashingWriter, "_write_raw", fail_second)
    with pytest.raises(_DiskFull, match="No space left"):
        atomic.write_atomically(str(tmp_path), "label", write, lambda _: "final")
    assert os.listdir(tmp_path) == ["final"]
    assert (tmp_path / "final").read_bytes() == b"old"


def test_a_failed_rename_removes_the_temporary(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        atomic.write_atomically(str(tmp_path), "label", lambda f: f.write(b"x"), lambda _: "final")
    assert os.listdir(tmp_path) == []


def test_unlink_of_a_missing_file_is_fine(tmp_path):
    atomic.unlink(str(tmp_path / "missing"))
    atomic.fsync_dir(str(tmp_path / "missing"))  # cannot open: nothing to do
