"""The layer stack only imports downward, and quack is imported in one place.

    reference, primitives  ->  kernels  ->  ops, layouts, autograd  ->  nn  ->  transformers
(``env`` and ``_validate`` are leaves any layer may use; ``_quack`` is the only module that
imports quack.)"""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coda")
RANK = {
    "reference": 0,
    "primitives": 0,
    "kernels": 1,
    "ops": 2,
    "layouts": 2,
    "autograd": 2,
    "nn": 3,
    "transformers": 4,
}
LEAVES = {"env", "_validate", "_quack", "__init__"}
# What each leaf may import from coda (``__init__`` is the package face: it re-exports).
LEAF_IMPORTS = {"env": {"_quack"}, "_validate": set(), "_quack": set()}


def layer_of(path: str) -> str:
    rel = os.path.relpath(path, ROOT)
    return rel.split(os.sep)[0].removesuffix(".py")


def coda_imports(path: str):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "coda":
            yield from (f"coda.{a.name}" for a in node.names)  # from coda import _validate
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def modules():
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def test_imports_only_go_down():
    bad = []
    for path in modules():
        src = layer_of(path)
        if src in LEAVES:
            continue
        for mod in coda_imports(path):
            parts = mod.split(".")
            if parts[0] != "coda" or len(parts) < 2 or parts[1] in LEAVES:
                continue
            if RANK[parts[1]] > RANK[src] or (
                RANK[parts[1]] == RANK[src]
                and parts[1] != src
                and src in ("reference", "primitives")
            ):
                bad.append(f"{os.path.relpath(path, ROOT)} imports {mod}")
    assert not bad, bad


def test_leaves_import_only_leaves():
    bad = []
    for path in modules():
        src = layer_of(path)
        if src not in LEAF_IMPORTS:
            continue
        for mod in coda_imports(path):
            parts = mod.split(".")
            if parts[0] == "coda" and (len(parts) < 2 or parts[1] not in LEAF_IMPORTS[src]):
                bad.append(f"{os.path.relpath(path, ROOT)} imports {mod}")
    assert not bad, bad


def test_quack_is_imported_only_by_the_seam():
    users = [
        os.path.relpath(p, ROOT)
        for p in modules()
        if any(m.split(".")[0] == "quack" for m in coda_imports(p))
    ]
    assert users == ["_quack.py"], users
