"""The design reference the code cites resolves: every identity tag ([I5.6]), every section
(``KERNELS.md 5.3``) and every step label (F0-F6, A1-A9, B1-B13) that a module, test,
benchmark or the README names is defined in ``docs/KERNELS.md``."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "KERNELS.md"
BRACKETS = re.compile(r"\[(I\d+\.\d+[^\]]*)\]")
TAG = re.compile(r"I?(\d+)\.(\d+)")
SECTION = re.compile(r"KERNELS\.md,? (?:section )?(\d+(?:\.\d+)?)\b")
LABELS = [f"F{i}" for i in range(7)] + [f"A{i}" for i in range(1, 10)]
LABELS += [f"B{i}" for i in range(1, 14)]


def _tags(text: str) -> set:
    """Every tag a bracket names; ``[I2.1-I2.3]`` and ``[I5.10]-[I5.14]`` name their range."""
    text = re.sub(r"\]-\[", "-", text)
    found = set()
    for group in BRACKETS.findall(text):
        for part in group.split(","):
            ends = [tuple(map(int, m)) for m in TAG.findall(part)]
            if len(ends) == 2 and "-" in part and ends[0][0] == ends[1][0]:
                found |= {(ends[0][0], k) for k in range(ends[0][1], ends[1][1] + 1)}
            else:
                found |= set(ends)
    return found


def _sources() -> dict:
    files = [*ROOT.glob("coda/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in [*files, ROOT / "README.md"]}


def test_every_cited_tag_and_section_is_defined():
    doc = DOC.read_text()
    defined = _tags(doc)
    headings = set(re.findall(r"^#+ (\d+(?:\.\d+)?)\.? ", doc, re.M))
    missing = []
    for name, text in _sources().items():
        missing += [f"{name}: [I{a}.{b}]" for a, b in sorted(_tags(text) - defined)]
        missing += [f"{name}: section {s}" for s in SECTION.findall(text) if s not in headings]
    assert not missing, missing


def test_every_step_label_is_defined():
    """Each label has a row of section 6's table (its first cell names it)."""
    cells = re.findall(r"^\| ([^|]+) \|", DOC.read_text(), re.M)
    named = {w for c in cells for w in re.split(r"[ ,]+", c)}
    assert [s for s in LABELS if s not in named] == []


def test_the_checker_sees_what_it_checks():
    """The parsers read the forms the code uses (a checker that found nothing would pass)."""
    got = _tags("x [I2.1-I2.3] y [I5.4, I5.5] z [I5.10]-[I5.12]")
    assert got == {(2, 1), (2, 2), (2, 3), (5, 4), (5, 5), (5, 10), (5, 11), (5, 12)}
    assert SECTION.findall("KERNELS.md 5.3: B2; (KERNELS.md section 4, CE-C)") == ["5.3", "4"]
    cited = set().union(*map(_tags, _sources().values()))
    assert len(cited) >= 20, cited
