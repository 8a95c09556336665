"""Every device record kept in ``benchmarks/results/`` (H200, and H100 where no H200 was
lent; loose, or inside one of its archives) names commits git has, and every record that
carries ``source_sha256`` (those since session 34) names the tree that ran: the digest of its
named commit's sources equals it (``benchmarks/provenance.py``). Records whose tree no commit
holds, or another commit than the one they name, are listed below with why; the test checks
that each still reads as explained, so the list cannot go stale."""

from __future__ import annotations

import functools
import io
import json
import re
import subprocess
import tarfile

import pytest

from benchmarks import provenance, records

HASH = re.compile(r"\b[0-9a-f]{7,40}\b")

# record -> the commit whose tree it ran (None: a tree no commit holds), and why
KNOWN = {
    # the call named HEAD (5bb38f5) while the next commit's probe_host_cpu.py and the launch
    # knob it sets (a no-op on the GPU) were still uncommitted in the working tree it carried
    "2026-12-03_h200_run156.json": "8e92284",
    # the before side of an A/B: b7f0289's coda/ and benchmarks/ beside HEAD's tests (its note)
    "2026-12-03_h200_run190.json": None,
}


def _history_or_skip():
    """Skip where the repository's history is not here (no git, or a shallow clone)."""
    try:
        shallow = subprocess.run(
            ["git", "-C", provenance.ROOT, "rev-parse", "--is-shallow-repository"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the records' commits cannot be read")
    if shallow == "true":
        pytest.skip("a shallow clone: the records' commits are not all here")


@functools.lru_cache(maxsize=None)
def _digest(commit: str) -> str | None:
    try:
        return provenance.commit_digest(commit)
    except subprocess.CalledProcessError:
        return None


def test_every_record_names_the_tree_that_ran():
    _history_or_skip()
    checked, wrong = 0, []
    for name, record in records.every():
        commit = str(record.get("commit", ""))
        unknown = [h for h in HASH.findall(commit) if _digest(h) is None]
        if not HASH.findall(commit) or unknown:
            wrong.append(f"{name}: commit {commit!r} names nothing git has ({unknown})")
            continue
        sha = record.get("source_sha256")
        if sha is None:
            continue
        checked += 1
        if name in KNOWN:
            ran = KNOWN[name]
            if ran is None:
                ok = sha != _digest(commit) and "copy" in record.get("note", "")
            else:
                ok = sha == _digest(ran) != _digest(commit)
            if not ok:
                wrong.append(f"{name}: no longer reads as KNOWN explains")
        elif sha != _digest(commit):
            wrong.append(f"{name}: source_sha256 {sha} is not {commit}'s tree ({_digest(commit)})")
    assert wrong == [] and checked >= 50, (checked, wrong)


def test_commit_digest_is_the_walk_of_the_same_tree(tmp_path):
    """``commit_digest`` reads git's tree in the walk's order (a folder's files before its
    subfolders, which git's own listing interleaves: ``a/x.py`` sorts before ``a_b.py``), so a
    clean checkout and its commit give one digest; an edited file gives another."""
    files = {
        "coda/a_b.py": "x = 1\n",
        "coda/a/x.py": "y = 2\n",
        "coda/z.py": "z = 3\n",
        "tests/t.py": "t = 4\n",
        "benchmarks/b.py": "b = 5\n",
        "demos/notes.txt": "not a source",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tree")
    walked = provenance.source_digest(str(tmp_path))
    assert provenance.commit_digest("HEAD", str(tmp_path)) == walked
    (tmp_path / "coda" / "a" / "x.py").write_text("y = 3\n")
    assert provenance.source_digest(str(tmp_path)) != walked
    with pytest.raises(subprocess.CalledProcessError):
        provenance.commit_digest("0000000", str(tmp_path))


def _results_folder(tmp_path, loose: dict, archived: dict):
    """A results folder with ``loose`` records as files and ``archived`` ones in one archive."""
    for name, record in loose.items():
        (tmp_path / name).write_text(json.dumps(record))
    with tarfile.open(tmp_path / "archive_a.tar.xz", "w:xz") as tar:
        for name, record in archived.items():
            data = json.dumps(record).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return tmp_path


def test_records_are_read_loose_or_archived_alike(tmp_path):
    """``records.load`` finds a record by its file name wherever it lies, ``records.every``
    yields each once (loose, then archived); a name in both places, or in none, is an error."""
    folder = _results_folder(tmp_path, {"x_run2.json": {"n": 2}}, {"x_run1.json": {"n": 1}})
    records._archived.cache_clear()
    assert records.load("x_run1.json", folder) == {"n": 1}
    assert records.load("x_run2.json", folder) == {"n": 2}
    assert list(records.every(folder)) == [("x_run2.json", {"n": 2}), ("x_run1.json", {"n": 1})]
    with pytest.raises(FileNotFoundError, match="x_run3.json"):
        records.load("x_run3.json", folder)
    (folder / "x_run1.json").write_text('{"n": 0}')
    with pytest.raises(ValueError, match="both loose and archived"):
        list(records.every(folder))
    records._archived.cache_clear()
