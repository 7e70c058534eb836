"""The manifest: which payload files make up one checkpoint, with their sizes and hashes.

A manifest is JSON::

    {
     "files": [{"name": "step-00000200.common.5d1c0e2b9a7f4c31.pt", "part": "common",
                "sha256": "5d1c0e2b9a7f4c31...", "size": 123456}],
     "format": "distamp.checkpoint/2",
     "manifest_sha256": "...",
     "step": 200,
     "world_size": 4
    }

``manifest_sha256`` is the SHA-256 of the other fields in canonical form
(sorted keys, no spaces), so a manifest that was edited or damaged is
refused. Each payload's name carries the first 16 hex digits of its
SHA-256, so a manifest whose hash was changed to match a different file no
longer names that file. Both catch accidents (a damaged disk, a hand
"repair"), not forgery: anyone who can write the directory can write a
consistent checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMMON",
    "FORMAT",
    "CheckpointCorrupt",
    "Manifest",
    "PayloadFile",
    "dcp_directory_name",
    "dcp_part",
    "manifest_name",
    "payload_name",
    "rank_part",
]

FORMAT = "distamp.checkpoint/2"
LEGACY_FORMAT = "distamp.checkpoint/1"  # one payload ``step-<N>.pt``, no manifest checksum
COMMON = "common"
"""The part every checkpoint has: what is the same on every rank, written by rank 0."""

_HASH_CHARS = 16  # 64 bits of the SHA-256 in a payload's name: unique among one step's saves
_PART = re.compile(r"^[a-z0-9-]+$")
_LEGACY_NAME = re.compile(r"^step-\d{8,}\.pt$")
_DCP_PART = re.compile(r"^dcp-\d{5,}$")
# A DCP file: <the save's directory>/<a name DCP chose>, never "..", never deeper.
_DCP_FILE = re.compile(r"^(step-\d{8,}\.dcp-[0-9a-f]{16})/\.?[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointCorrupt(Exception):
    """A checkpoint that cannot be used: missing, truncated, corrupted or unreadable.

    Attributes:
        path: the file at fault.
        reason: why, in words.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class PayloadFile:
    """One payload file as a manifest records it.

    Attributes:
        part: what the file holds: ``"common"``, or ``rank_part(r)`` for
            what only rank ``r`` holds.
        name: the file name inside the checkpoint directory.
        size: its size in bytes.
        sha256: its SHA-256, hex.
    """

    part: str
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What one checkpoint consists of; written last, it commits the checkpoint.

    Attributes:
        step: the step number.
        world_size: the number of ranks of the job that saved it.
        files: the payload files, one per part.
    """

    step: int
    world_size: int
    files: tuple[PayloadFile, ...]

    def file(self, part: str) -> PayloadFile:
        """The payload file holding ``part``; ``KeyError`` when there is none."""
        for f in self.files:
            if f.part == part:
                return f
        raise KeyError(part)

    def to_bytes(self) -> bytes:
        """The manifest as JSON, with a SHA-256 over its own content."""
        files = [{"part": f.part, "name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files]
        body = {"format": FORMAT, "step": self.step, "world_size": self.world_size, "files": files}
        return json.dumps({**body, "manifest_sha256": _checksum(body)}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> Manifest:
        """Parse and check a manifest read from ``path``; ``CheckpointCorrupt`` if it is not valid."""
        try:
            manifest = _parse(_json_object(data), path)
        except CheckpointCorrupt:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorrupt(path, f"unreadable manifest ({type(exc).__name__}: {exc})") from exc
        return manifest


def _json_object(data: bytes) -> dict[str, Any]:
    """``data`` parsed as JSON; TypeError unless it is an object."""
    meta = json.loads(data)
    if not isinstance(meta, dict):
        raise TypeError(f"a JSON {type(meta).__name__}, not an object")
    return meta


def _checksum(body: dict[str, Any]) -> str:
    # Canonical form, so the checksum does not depend on indentation or key order.
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _parse(meta: dict[str, Any], path: str) -> Manifest:
    if meta.get("format") == LEGACY_FORMAT:  # read, so that an upgrade mid-job resumes
        name = str(meta["file"])
        if not _LEGACY_NAME.match(name):
            raise ValueError(f"payload name {name!r} is not step-<N>.pt")
        files = (PayloadFile(COMMON, name, int(meta["size"]), str(meta["sha256"])),)
        return Manifest(int(meta["step"]), int(meta["world_size"]), files)
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')!r} is not {FORMAT!r}")
    body = {k: v for k, v in meta.items() if k != "manifest_sha256"}
    if meta.get("manifest_sha256") != _checksum(body):
        raise CheckpointCorrupt(path, "manifest checksum mismatch: the manifest was edited or corrupted")
    manifest = Manifest(
        step=int(body["step"]),
        world_size=int(body["world_size"]),
        files=tuple(
            PayloadFile(str(f["part"]), str(f["name"]), int(f["size"]), str(f["sha256"])) for f in body["files"]
        ),
    )
    for f in manifest.files:
        check_part(f.part)  # a name from the manifest must stay inside the directory
        if _DCP_PART.match(f.part):
            m = _DCP_FILE.match(f.name)
            if m is None or not m.group(1).startswith(f"step-{manifest.step:08d}."):
                raise CheckpointCorrupt(path, f"names DCP file {f.name!r}, which is not in a DCP directory of its step")
        elif f.name != payload_name(manifest.step, f.part, f.sha256):
            raise CheckpointCorrupt(path, f"names payload {f.name!r}, whose name does not carry its SHA-256")
    return manifest


def rank_part(rank: int) -> str:
    """The part name for what only ``rank`` holds (e.g. its optimizer-state shard)."""
    return f"rank-{rank:05d}"


def dcp_part(index: int) -> str:
    """The part name of the ``index``-th file of a checkpoint's DCP directory (stage-3 tensors)."""
    return f"dcp-{index:05d}"


def dcp_directory_name(step: int, nonce: str) -> str:
    """The DCP directory of one save of ``step``: ``nonce`` (16 hex digits, new per save) keeps every save apart,
    as the hash in a payload's name does."""
    return f"step-{step:08d}.dcp-{nonce}"


def check_part(part: str) -> str:
    """``part`` if it can go into a file name; ``ValueError`` otherwise."""
    if not isinstance(part, str) or not _PART.match(part):
        raise ValueError(f"part={part!r} must be lowercase letters, digits and '-', e.g. 'common' or 'rank-00003'")
    return part


def manifest_name(step: int) -> str:
    """``step-<step>.json``, zero-padded so names sort by step."""
    return f"step-{step:08d}.json"


def payload_name(step: int, part: str, sha256: str) -> str:
    """A payload's file name: the hash in the name ties the name to one content."""
    return f"step-{step:08d}.{part}.{sha256[:_HASH_CHARS]}.pt"
