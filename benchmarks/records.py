"""The device records kept under ``benchmarks/results/``, read the same whether a record lies
loose or inside one of the folder's ``.tar.xz`` archives (which keep the tracked tree under the
4 MB a GPU call carries), so that whatever reads records (the README's figures, the records'
provenance check, ``records_energy.py``) sees every one of them and need not know where it is.

    load("2026-12-04_h200_run252.json")   # one record by its file name
    for name, record in every(): ...      # all of them, loose first, then each archive's
"""

from __future__ import annotations

import functools
import json
import pathlib
import tarfile

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


@functools.lru_cache(maxsize=None)
def _archived(results: pathlib.Path) -> dict[str, dict]:
    """{file name: record} of every JSON record inside the archives under ``results``."""
    found = {}
    for archive in sorted(results.glob("*.tar.xz")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".json"):
                    name = pathlib.PurePosixPath(member.name).name
                    if name in found:
                        raise ValueError(f"record {name} in two archives ({archive.name})")
                    found[name] = json.load(tar.extractfile(member))
    return found


def every(results: pathlib.Path = RESULTS):
    """Yields (file name, record) for every record under ``results``: the loose ones by name,
    then the archived ones by name. A name both loose and archived is an error: the two could
    differ, and which one a reader meant could not be told."""
    loose = sorted(results.glob("*.json"))
    archived = _archived(results)
    both = sorted({p.name for p in loose} & archived.keys())
    if both:
        raise ValueError(f"records both loose and archived: {both}")
    for path in loose:
        yield path.name, json.loads(path.read_text())
    yield from sorted(archived.items())


def load(name: str, results: pathlib.Path = RESULTS) -> dict:
    """The record whose file name is ``name``, loose or archived."""
    path = results / name
    if path.is_file():
        return json.loads(path.read_text())
    archived = _archived(results)
    if name not in archived:
        raise FileNotFoundError(f"no record {name} under {results.name}/, loose or archived")
    return archived[name]
