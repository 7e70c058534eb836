"""distamp.checkpoint.manifest: a manifest verifies itself and is bound to its payloads' content."""

from __future__ import annotations

import hashlib
import json

import pytest

from distamp.checkpoint.manifest import (
    COMMON,
    FORMAT,
    CheckpointCorrupt,
    Manifest,
    PayloadFile,
    check_part,
    manifest_name,
    payload_name,
    rank_part,
)

SHA_A = hashlib.sha256(b"a").hexdigest()
SHA_B = hashlib.sha256(b"b").hexdigest()


def make(step=20) -> Manifest:
    files = (
        PayloadFile(COMMON, payload_name(step, COMMON, SHA_A), 1, SHA_A),
        PayloadFile(rank_part(1), payload_name(step, rank_part(1), SHA_B), 1, SHA_B),
    )
    return Manifest(step=step, world_size=2, files=files)


def test_names():
    assert manifest_name(20) == "step-00000020.json"
    assert payload_name(20, COMMON, SHA_A) == f"step-00000020.common.{SHA_A[:16]}.pt"
    assert rank_part(3) == "rank-00003"
    assert check_part("rank-00003") == "rank-00003"
    with pytest.raises(ValueError, match=r"part='../x' must be lowercase letters, digits and '-'"):
        check_part("../x")


def test_round_trip_with_several_parts():
    manifest = make()
    meta = json.loads(manifest.to_bytes())
    assert meta["format"] == FORMAT
    assert len(meta["manifest_sha256"]) == 64
    again = Manifest.from_bytes(manifest.to_bytes(), "m.json")
    assert again == manifest
    assert again.file(rank_part(1)).sha256 == SHA_B
    with pytest.raises(KeyError):
        again.file(rank_part(0))


def edit(manifest: Manifest, change, recompute_checksum: bool) -> bytes:
    meta = json.loads(manifest.to_bytes())
    change(meta)
    if recompute_checksum:
        body = {k: v for k, v in meta.items() if k != "manifest_sha256"}
        meta["manifest_sha256"] = hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
    return json.dumps(meta).encode()


def swap_hash(meta):
    """What "repairing" a manifest after its payload changed would do: new hash and size."""
    meta["files"][0]["sha256"] = SHA_B
    meta["files"][0]["size"] = 99


def test_an_edited_manifest_fails_its_own_checksum():
    with pytest.raises(CheckpointCorrupt, match=r"m\.json: manifest checksum mismatch"):
        Manifest.from_bytes(edit(make(), swap_hash, recompute_checksum=False), "m.json")


def test_a_hash_that_no_longer_matches_the_payloads_name_is_refused():
    with pytest.raises(CheckpointCorrupt, match=r"names payload 'step-00000020.common.[0-9a-f]{16}.pt', whose name"):
        Manifest.from_bytes(edit(make(), swap_hash, recompute_checksum=True), "m.json")


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b'{"format": "other/1"}'])
def test_garbage_is_an_unreadable_manifest(data):
    with pytest.raises(CheckpointCorrupt, match=r"m\.json: unreadable manifest"):
        Manifest.from_bytes(data, "m.json")


def test_format_1_manifests_are_still_read():
    legacy = {"format": "distamp.checkpoint/1", "step": 7, "file": "step-00000007.pt", "size": 3,
              "sha256": SHA_A, "world_size": 1}
    manifest = Manifest.from_bytes(json.dumps(legacy).encode(), "m.json")
    assert manifest == Manifest(7, 1, (PayloadFile(COMMON, "step-00000007.pt", 3, SHA_A),))


def test_a_manifest_cannot_name_a_file_outside_the_directory():
    bad = Manifest(3, 1, (PayloadFile("../x", payload_name(3, "../x", SHA_A), 1, SHA_A),))
    with pytest.raises(CheckpointCorrupt, match=r"unreadable manifest \(ValueError: part='../x' must be"):
        Manifest.from_bytes(bad.to_bytes(), "m.json")
    legacy = {"format": "distamp.checkpoint/1", "step": 7, "file": "../../etc/passwd", "size": 3,
              "sha256": SHA_A, "world_size": 1}
    with pytest.raises(CheckpointCorrupt, match=r"payload name '../../etc/passwd' is not step-<N>.pt"):
        Manifest.from_bytes(json.dumps(legacy).encode(), "m.json")
