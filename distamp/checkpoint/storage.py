"""A checkpoint directory: payloads and manifests written, listed, verified, rotated.

This module knows files, not training state. Payloads are written first,
each under a name that carries its hash, so no earlier checkpoint's file is
ever overwritten with other content; renaming the manifest into place is
the single commit point; files the committed manifest no longer names are
removed only afterwards. So at every instant the newest committed
checkpoint is on disk intact, even while the same step is saved again.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from .atomic import TMP_PREFIX, fsync_dir, sha256_of, unlink, write_atomically
from .manifest import (
    CheckpointCorrupt,
    Manifest,
    PayloadFile,
    check_part,
    manifest_name,
    payload_name,
)

__all__ = [
    "check_directory",
    "commit",
    "discard",
    "list_checkpoints",
    "read_manifest",
    "rotate",
    "verify",
    "write_payload",
]

logger = logging.getLogger("distamp")

_MANIFEST = re.compile(r"^step-(\d{8,})\.json$")
_PAYLOAD = re.compile(r"^step-(\d{8,})\.[a-z0-9-]+\.[0-9a-f]{16}\.pt$")
_LEGACY_PAYLOAD = re.compile(r"^step-(\d{8,})\.pt$")
_DCP_DIRECTORY = re.compile(r"^step-(\d{8,})\.dcp-[0-9a-f]{16}$")


def check_directory(directory: Any) -> str:
    """``directory`` as a str path; ``TypeError``/``ValueError`` when it cannot be one."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
    path = os.fspath(directory)
    if isinstance(path, bytes) or not path:
        raise ValueError(f"directory={directory!r} is not a usable directory path; pass a non-empty str")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"directory={path!r} exists and is not a directory; choose another checkpoint directory")
    return path


# ----------------------------------------------------------------------------- writing


def write_payload(directory: str, step: int, part: str, write: Callable[[BinaryIO], Any]) -> PayloadFile:
    """Write one payload file with ``write(fileobj)``, named after its content's hash.

    The file belongs to no checkpoint until :func:`commit` writes a manifest
    naming it. A save of other content for the same step gets another
    name, so the committed checkpoint stays intact meanwhile.
    """
    check_part(part)
    name, sha, size = write_atomically(
        directory, f"step-{step:08d}.{part}.pt", write, lambda sha: payload_name(step, part, sha)
    )
    return PayloadFile(part=part, name=name, size=size, sha256=sha)


def commit(directory: str, manifest: Manifest) -> None:
    """Write ``manifest`` atomically: from this rename on, the checkpoint exists."""
    text = manifest.to_bytes()
    name = manifest_name(manifest.step)
    write_atomically(directory, name, lambda f: f.write(text), lambda _: name)


# ----------------------------------------------------------------------------- reading


def list_checkpoints(directory: str | os.PathLike) -> list[int]:
    """Step numbers with a manifest or payload file in ``directory``, newest first.

    Presence is not completeness: :func:`read_manifest` and :func:`verify`
    check. Returns ``[]`` when the directory does not exist.
    """
    path = check_directory(directory)
    return sorted(_files_by_step(path), reverse=True)


def _files_by_step(directory: str) -> dict[int, list[str]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    steps: dict[int, list[str]] = {}
    for name in names:
        m = _MANIFEST.match(name) or _PAYLOAD.match(name) or _LEGACY_PAYLOAD.match(name) or _DCP_DIRECTORY.match(name)
        if m:
            steps.setdefault(int(m.group(1)), []).append(name)
    return steps


def read_manifest(directory: str, step: int) -> Manifest:
    """The manifest of checkpoint ``step``; ``CheckpointCorrupt`` when missing or invalid."""
    path = os.path.join(directory, manifest_name(step))
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        orphans = sorted(n for n in _files_by_step(directory).get(step, []) if n != manifest_name(step))
        found = f"; {', '.join(orphans)} without one" if orphans else ""
        raise CheckpointCorrupt(path, f"no manifest (the save did not finish{found})") from None
    except OSError as exc:
        raise CheckpointCorrupt(path, f"unreadable manifest ({type(exc).__name__}: {exc})") from exc
    manifest = Manifest.from_bytes(data, path)
    if manifest.step != step:
        raise CheckpointCorrupt(path, f"unreadable manifest: it is for step {manifest.step}, not {step}")
    return manifest


def verify(directory: str, manifest: Manifest, parts: Iterable[str]) -> None:
    """Check that the payload files of ``parts`` match the manifest's size and SHA-256.

    A reader checks only the parts it will load. ``CheckpointCorrupt``
    names the first file that is missing, truncated or corrupted.
    """
    for part in parts:
        try:
            expected = manifest.file(part)
        except KeyError:
            path = os.path.join(directory, manifest_name(manifest.step))
            raise CheckpointCorrupt(path, f"names no {part!r} payload") from None
        path = os.path.join(directory, expected.name)
        try:
            sha, size = sha256_of(path)
        except FileNotFoundError:
            raise CheckpointCorrupt(path, f"payload missing (named by {manifest_name(manifest.step)})") from None
        except OSError as exc:
            raise CheckpointCorrupt(path, f"unreadable ({exc})") from exc
        if size != expected.size:
            raise CheckpointCorrupt(path, f"{size} bytes but the manifest says {expected.size} (truncated?)")
        if sha != expected.sha256:
            raise CheckpointCorrupt(
                path, f"SHA-256 {sha[:12]}... does not match the manifest's {expected.sha256[:12]}... (corrupted)"
            )


# ----------------------------------------------------------------------------- removing


def _committed_names(directory: str, step: int) -> set[str] | None:
    """The payload names the manifest of ``step`` commits, with the DCP directory of its DCP files; None without a
    valid manifest."""
    try:
        names = {f.name for f in read_manifest(directory, step).files}
    except CheckpointCorrupt:
        return None
    return names | {name.split("/")[0] for name in names}


def _remove(path: str) -> None:
    """Remove a payload file, or a DCP directory with what it holds."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        unlink(path)


def discard(directory: str, step: int, names: Iterable[str]) -> None:
    """Remove payload files a failed save wrote, except those a committed manifest names.

    A save of unchanged content writes the very name the committed
    checkpoint of that step already uses; that file must stay. Errors are
    logged, not raised: the caller is already reporting the failure that
    led here.
    """
    keep = _committed_names(directory, step) or set()
    for name in names:
        if name in keep:
            continue
        try:
            _remove(os.path.join(directory, name))
        except OSError as exc:
            logger.warning("could not remove %s after a failed save: %s", os.path.join(directory, name), exc)


def rotate(directory: str, newest: int, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints up to ``newest``; remove everything else.

    Removed: checkpoints newer than ``newest`` (left by a run that was
    resumed from an earlier one), committed ones beyond ``keep``, files of
    saves that never committed or whose manifest is invalid, payloads a kept
    manifest no longer names (the previous content of a re-saved step) and
    stale temporary files. Call it only after :func:`commit`.
    """
    by_step = _files_by_step(directory)
    kept = 0
    for step in sorted(by_step, reverse=True):
        committed = _committed_names(directory, step)
        if step <= newest and kept < keep and committed is not None:
            kept += 1
            doomed = [n for n in by_step[step] if n not in committed and n != manifest_name(step)]
        else:
            if step > newest:
                logger.info("removing checkpoint %d: newer than the step being saved (%d)", step, newest)
            # Manifest first: a half-removed checkpoint must not look committed.
            doomed = sorted(by_step[step], key=lambda n: n != manifest_name(step))
        for name in doomed:
            _remove(os.path.join(directory, name))
    for name in os.listdir(directory):
        if name.startswith(TMP_PREFIX):  # left by a writer that was killed
            unlink(os.path.join(directory, name))
    fsync_dir(directory)
