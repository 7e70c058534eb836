"""distamp.checkpoint.storage: commit by manifest, several payload parts, verification, rotation, crashes."""

from __future__ import annotations

import os
import shutil

import pytest

from distamp.checkpoint import storage
from distamp.checkpoint.atomic import sha256_of
from distamp.checkpoint.manifest import (
    COMMON,
    CheckpointCorrupt,
    Manifest,
    PayloadFile,
    dcp_directory_name,
    dcp_part,
    manifest_name,
    rank_part,
)


def save(directory, step: int, content: bytes, parts=(COMMON,)) -> Manifest:
    """A checkpoint whose every part holds ``content`` + the part name, committed last."""
    files = tuple(
        storage.write_payload(str(directory), step, part, lambda f, p=part: f.write(content + p.encode()))
        for part in parts
    )
    manifest = Manifest(step=step, world_size=len(parts), files=files)
    storage.commit(str(directory), manifest)
    return manifest


def read(directory, step: int, parts=(COMMON,)) -> dict[str, bytes]:
    manifest = storage.read_manifest(str(directory), step)
    storage.verify(str(directory), manifest, parts)
    return {p: (directory / manifest.file(p).name).read_bytes() for p in parts}


def test_a_checkpoint_of_several_parts_reads_back_part_by_part(tmp_path):
    parts = (COMMON, rank_part(0), rank_part(1))
    manifest = save(tmp_path, 20, b"x", parts)
    assert sorted(os.listdir(tmp_path)) == sorted([manifest_name(20)] + [f.name for f in manifest.files])
    assert read(tmp_path, 20, parts) == {p: b"x" + p.encode() for p in parts}
    # A reader that needs only some parts is not held up by the others.
    (tmp_path / manifest.file(rank_part(1)).name).write_bytes(b"damaged")
    assert read(tmp_path, 20, (COMMON, rank_part(0)))[COMMON] == b"xcommon"
    with pytest.raises(CheckpointCorrupt, match=r"step-00000020\.rank-00001\..*bytes but the manifest says"):
        read(tmp_path, 20, (rank_part(1),))
    with pytest.raises(CheckpointCorrupt, match=r"step-00000020.json: names no 'rank-00002' payload"):
        read(tmp_path, 20, (rank_part(2),))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "bytes but the manifest says 10 .truncated"),
        (lambda p: p.write_bytes(b"X" + p.read_bytes()[1:]), "does not match the manifest's .* .corrupted"),
        (lambda p: p.unlink(), r"payload missing \(named by step-00000020.json\)"),
    ],
)
def test_verify_names_the_damaged_file(tmp_path, damage, reason):
    manifest = save(tmp_path, 20, b"abcd")  # "abcd" + "common": 10 bytes
    damage(tmp_path / manifest.file(COMMON).name)
    with pytest.raises(CheckpointCorrupt, match=f"{manifest.file(COMMON).name}: .*{reason}"):
        read(tmp_path, 20)


def test_a_payload_without_manifest_is_listed_but_not_a_checkpoint(tmp_path):
    save(tmp_path, 10, b"a")
    orphan = storage.write_payload(str(tmp_path), 20, COMMON, lambda f: f.write(b"b"))
    assert storage.list_checkpoints(tmp_path) == [20, 10]
    assert storage.list_checkpoints(tmp_path / "missing") == []
    with pytest.raises(CheckpointCorrupt, match=rf"no manifest \(the save did not finish; {orphan.name} without one\)"):
        storage.read_manifest(str(tmp_path), 20)


def test_discard_spares_a_file_the_committed_manifest_names(tmp_path):
    committed = save(tmp_path, 10, b"same").file(COMMON)
    # A re-save of unchanged content wrote the very same name, then failed.
    again = storage.write_payload(str(tmp_path), 10, COMMON, lambda f: f.write(b"samecommon"))
    other = storage.write_payload(str(tmp_path), 10, COMMON, lambda f: f.write(b"new"))
    assert again.name == committed.name != other.name
    storage.discard(str(tmp_path), 10, [again.name, other.name])
    assert sorted(os.listdir(tmp_path)) == sorted([committed.name, manifest_name(10)])
    assert read(tmp_path, 10) == {COMMON: b"samecommon"}


def test_rotate_keeps_the_newest_committed_and_removes_everything_else(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step, b"old")
    replaced = storage.read_manifest(str(tmp_path), 30).file(COMMON).name
    keep = save(tmp_path, 30, b"new")  # re-saved: the old payload is now named by nothing
    save(tmp_path, 40, b"abandoned")  # newer than the step being saved: from a run resumed earlier
    storage.write_payload(str(tmp_path), 25, COMMON, lambda f: f.write(b"never committed"))
    (tmp_path / ".tmp-1-abcd-step-00000050.common.pt").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not ours")
    storage.rotate(str(tmp_path), 30, keep=2)
    expected = {manifest_name(30), keep.file(COMMON).name, manifest_name(20),
                storage.read_manifest(str(tmp_path), 20).file(COMMON).name, "notes.txt"}
    assert set(os.listdir(tmp_path)) == expected
    assert replaced not in expected


def test_rotate_does_not_count_a_checkpoint_with_a_damaged_manifest(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step, b"x")
    (tmp_path / manifest_name(20)).write_text("{}")
    storage.rotate(str(tmp_path), 30, keep=2)
    assert storage.list_checkpoints(tmp_path) == [30, 10]


def snapshots_of_a_resave(tmp_path, monkeypatch, step_content):
    """Copies of the directory before and after every rename and removal while re-saving."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save(directory, 10, b"first")
    copies = []
    real_replace, real_unlink = os.replace, os.unlink

    def snapshot():
        copy = tmp_path / f"crash-{len(copies)}"
        shutil.copytree(directory, copy)
        copies.append(copy)

    def replace(src, dst):
        snapshot()
        real_replace(src, dst)
        snapshot()

    def unlink(path):
        snapshot()
        real_unlink(path)
        snapshot()

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    save(directory, 10, step_content)
    storage.rotate(str(directory), 10, keep=1)
    monkeypatch.undo()
    return copies


@pytest.mark.parametrize("content", [b"second", b"first"], ids=["new content", "same content"])
def test_a_crash_at_any_point_of_a_resave_leaves_one_intact_checkpoint(tmp_path, monkeypatch, content):
    copies = snapshots_of_a_resave(tmp_path, monkeypatch, content)
    assert len(copies) >= 4  # two renames (and for new content the old payload's removal), before and after
    seen = set()
    for copy in copies:
        assert storage.list_checkpoints(copy) == [10]
        seen.add(read(copy, 10)[COMMON])  # intact: manifest and payload agree
    assert seen == {b"firstcommon", content + b"common"}


def save_with_dcp(directory, step: int, nonce: str) -> Manifest:
    """A checkpoint with a common payload and a DCP directory of two files, committed last."""
    dcp_directory = dcp_directory_name(step, nonce)
    os.makedirs(directory / dcp_directory)
    files = [storage.write_payload(str(directory), step, COMMON, lambda f: f.write(b"common"))]
    for i, name in enumerate([".metadata", "__0_0.distcp"]):
        (directory / dcp_directory / name).write_bytes(name.encode() + nonce.encode())
        sha, size = sha256_of(str(directory / dcp_directory / name))
        files.append(PayloadFile(dcp_part(i), f"{dcp_directory}/{name}", size, sha))
    manifest = Manifest(step=step, world_size=1, files=tuple(files))
    storage.commit(str(directory), manifest)
    return manifest


def test_dcp_directories_are_listed_verified_rotated_and_discarded_with_their_checkpoint(tmp_path):
    for step in (10, 20, 30):
        save_with_dcp(tmp_path, step, f"{step:016x}")
    os.makedirs(tmp_path / dcp_directory_name(40, "f" * 16))  # a save killed before its commit
    assert storage.list_checkpoints(str(tmp_path)) == [40, 30, 20, 10]
    with pytest.raises(CheckpointCorrupt, match=r"no manifest \(the save did not finish; step-00000040.dcp-f+ "):
        storage.read_manifest(str(tmp_path), 40)
    manifest = storage.read_manifest(str(tmp_path), 30)
    storage.verify(str(tmp_path), manifest, ["dcp-00000", "dcp-00001"])
    damaged = tmp_path / dcp_directory_name(30, f"{30:016x}") / "__0_0.distcp"
    damaged.write_bytes(b"x" * damaged.stat().st_size)
    with pytest.raises(CheckpointCorrupt, match="does not match the manifest's"):
        storage.verify(str(tmp_path), manifest, ["dcp-00001"])
    storage.rotate(str(tmp_path), 30, keep=2)
    assert sorted(n for n in os.listdir(tmp_path) if ".dcp-" in n) == [dcp_directory_name(20, f"{20:016x}"),
                                                                        dcp_directory_name(30, f"{30:016x}")]
    storage.discard(str(tmp_path), 30, [dcp_directory_name(30, "e" * 16)])  # a name it does not hold: no error
    storage.discard(str(tmp_path), 20, [dcp_directory_name(20, f"{20:016x}")])  # committed: spared
    assert (tmp_path / dcp_directory_name(20, f"{20:016x}") / ".metadata").exists()


def test_a_manifest_naming_a_dcp_file_outside_its_steps_dcp_directory_is_refused(tmp_path):
    manifest = save_with_dcp(tmp_path, 10, "0" * 16)
    for name in ("step-00000010.dcp-0000000000000000/../step-00000010.json", "elsewhere/__0_0.distcp",
                 "step-00000011.dcp-0000000000000000/__0_0.distcp"):
        files = (*manifest.files[:1], PayloadFile("dcp-00000", name, 1, "0" * 64))
        storage.commit(str(tmp_path), Manifest(step=10, world_size=1, files=files))
        with pytest.raises(CheckpointCorrupt, match="not in a DCP directory of its step"):
            storage.read_manifest(str(tmp_path), 10)
