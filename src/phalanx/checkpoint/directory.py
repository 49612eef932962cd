"""Where checkpoints live, and what makes one valid. A root is a local path or an fsspec URL (``s3://bucket/run``;
s3fs reads credentials and ``AWS_ENDPOINT_URL`` from the usual environment variables):

    <root>/step-00000050/   DCP's shard files (__<rank>_<n>.distcp) and .metadata, then
                            manifest.json  (step, world layout, spec hash, model, every file's size and checksum)
                            COMMITTED      (the manifest's sha256, written last: the checkpoint exists from then on)

On local disk each of the two is written to a temporary name, fsynced and renamed; in an object store each
is a single PUT, which is all-or-nothing. Deletion removes the marker first, so a checkpoint half deleted
is never taken for a valid one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from phalanx.storage import DIGESTS, file_digest, write_atomic

MANIFEST, COMMITTED = "manifest.json", "COMMITTED"
CHECKSUM = "xxh3_128"  # each file's in the manifest; why this one: phalanx.storage.DIGESTS
STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointDir:
    def __init__(self, root: str | Path):
        self.url = str(root)
        self.fs, self.root = url_to_fs(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def __str__(self) -> str:
        return self.url

    def path(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step-{step:08d}"

    def location(self, step: int) -> str:
        """The step's location as the user names it and DCP takes it: a plain path locally (DCP's
        FileSystemWriter, which fsyncs each file), a URL elsewhere (DCP then goes through fsspec)."""
        path = self.path(step)
        return path if self.local else self.fs.unstrip_protocol(path)

    def steps(self) -> list[int]:
        """Steps that have a checkpoint directory, committed or not, oldest first."""
        self.fs.invalidate_cache(self.root)  # other processes write here: never answer from a stale listing
        if not self.fs.isdir(self.root):
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))
        return sorted(int(m[1]) for name in names if (m := STEP_DIR.fullmatch(name)))

    def committed(self, step: int) -> bool:
        return self.fs.isfile(f"{self.path(step)}/{COMMITTED}")

    def newest_committed(self) -> int | None:
        """The newest committed step (not verified: loading does that), looked for from the newest down."""
        return next((step for step in reversed(self.steps()) if self.committed(step)), None)

    def size(self, step: int) -> int:
        return int(self.fs.du(self.path(step)))

    def files(self, step: int) -> list[str]:
        """Names of the files in the step's directory, freshly listed."""
        path = self.path(step)
        self.fs.invalidate_cache(path)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False))

    def describe_file(self, step: int, name: str) -> dict[str, Any]:
        path = f"{self.path(step)}/{name}"
        return {"size": int(self.fs.size(path)), CHECKSUM: file_digest(path, CHECKSUM, self.fs)}

    def commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Write the manifest, then the marker: the checkpoint becomes visible, whole."""
        path = self.path(step)
        data = json.dumps(manifest, indent=1).encode()
        write_atomic(f"{path}/{MANIFEST}", data, self.fs)
        write_atomic(f"{path}/{COMMITTED}", hashlib.sha256(data).hexdigest().encode(), self.fs)

    def manifest(self, step: int) -> dict[str, Any]:
        return json.loads(self.fs.cat_file(f"{self.path(step)}/{MANIFEST}"))

    def verify(self, step: int) -> str | None:
        """Why the checkpoint of ``step`` is not valid, or None if it is (marker present and matching the
        manifest, every file the manifest lists present with its size and checksum: xxh3_128, or sha256 in
        checkpoints written before)."""
        path = self.path(step)
        self.fs.invalidate_cache(path)
        try:
            marker = self.fs.cat_file(f"{path}/{COMMITTED}").decode()
        except FileNotFoundError:
            return "no commit marker (the save did not finish)"
        try:
            data = self.fs.cat_file(f"{path}/{MANIFEST}")
        except OSError as e:
            return f"unreadable {MANIFEST} ({e})"
        if hashlib.sha256(data).hexdigest() != marker.strip():
            return f"{MANIFEST} does not match the sha256 in {COMMITTED} (corrupt)"
        files = json.loads(data)["files"]
        for name, meta in files.items():
            f = f"{path}/{name}"
            if not self.fs.isfile(f):
                return f"{name} is missing"
            if (size := self.fs.size(f)) != meta["size"]:
                return f"{name} is {size} bytes, the manifest says {meta['size']}"
            algorithm = next((a for a in DIGESTS if a in meta), None)
            if algorithm is None:
                return f"the manifest gives {name} no checksum (one of {', '.join(DIGESTS)})"
            if file_digest(f, algorithm, self.fs) != meta[algorithm]:
                return f"{name} does not match its {algorithm} in the manifest (corrupt)"
        return None

    def latest_valid(self, skipped: Callable[[int, str], None] = lambda step, why: None) -> int | None:
        """The newest step whose checkpoint verifies; each newer one that does not is passed to ``skipped``."""
        for step in reversed(self.steps()):
            if (problem := self.verify(step)) is None:
                return step
            skipped(step, problem)
        return None

    def retire(self, keep_last: int, keep_every: int | None) -> None:
        """Delete the committed checkpoints that neither the newest ``keep_last`` nor ``keep_every`` keep; nothing
        else (a save in progress has no marker yet)."""
        committed = [s for s in self.steps() if self.committed(s)]
        keep = set(committed[-keep_last:])
        if keep_every:
            keep |= {s for s in committed if s % keep_every == 0}
        for step in committed:
            if step not in keep:
                self.remove(step)

    def remove(self, step: int) -> None:
        path = self.path(step)
        if self.fs.exists(f"{path}/{COMMITTED}"):
            self.fs.rm_file(f"{path}/{COMMITTED}")
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
