"""What tree a GPU record ran: a digest of its Python sources, from the files on a machine or
from a commit in git, so that a record's ``commit`` can be checked against its
``source_sha256`` without checking anything out.

A record names the commit the call was told (``gpu_suite.py --commit``); the GPU machine's own
git checkout can be stale (run 151's was) and a literal can be mistyped (run 212's was), but
the files that ran are what the digest names. ``tests/test_records.py`` checks every record
kept under ``benchmarks/results/`` this way.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ("coda", "benchmarks", "tests", "demos")  # what a record's digest covers


def _digest(entries) -> str:
    """sha256 (16 hex digits) over (relative path, bytes) pairs in the order given."""
    h = hashlib.sha256()
    for rel, data in entries:
        h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


def _walk_order(rel: str):
    """A path's place in the digest's order: ``SOURCE_DIRS`` in turn, and inside each the
    order of ``os.walk`` with sorted names (a folder's own files, then each subfolder)."""
    top, *folders, name = rel.split("/")
    return [(SOURCE_DIRS.index(top), "")] + [(1, f) for f in folders] + [(0, name)]


def source_digest(root: str = ROOT) -> str:
    """The digest of every ``.py`` file under ``SOURCE_DIRS`` of ``root``, by relative path
    and bytes, in sorted walk order: the tree that ran, named by its content. Anyone can check
    a commit: ``commit_digest(commit)``, or check it out clean and ``python -c "from
    benchmarks.provenance import source_digest as s; print(s())"``."""
    paths = []
    for top in SOURCE_DIRS:
        for dirpath, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    full = os.path.join(dirpath, f)
                    paths.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    paths.sort(key=lambda p: _walk_order(p[0]))

    def read(full):
        with open(full, "rb") as fh:
            return fh.read()

    return _digest((rel, read(full)) for rel, full in paths)


def _git(repo: str, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", "-C", repo, *args], input=data, capture_output=True, check=True
    ).stdout


def commit_digest(commit: str, repo: str = ROOT) -> str:
    """``source_digest`` of ``commit``'s tree, read from git (raises ``CalledProcessError``
    for a commit git does not have)."""
    sha = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").decode().strip()
    listing = _git(repo, "ls-tree", "-r", "-z", sha, "--", *SOURCE_DIRS).split(b"\0")
    blobs = []
    for line in filter(None, listing):
        meta, path = line.decode().split("\t", 1)
        _, kind, blob = meta.split()
        if kind == "blob" and path.endswith(".py"):
            blobs.append((path, blob))
    blobs.sort(key=lambda b: _walk_order(b[0]))
    batch = _git(repo, "cat-file", "--batch", data="".join(b + "\n" for _, b in blobs).encode())
    contents, at = [], 0
    for _ in blobs:  # "<sha> blob <size>\n<bytes>\n" each
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        contents.append(batch[header_end + 1 : header_end + 1 + size])
        at = header_end + 1 + size + 1
    return _digest((path, data) for (path, _), data in zip(blobs, contents))
