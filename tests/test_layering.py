"""The layer stack only imports downward, quack is imported in one place, and the plain
memos (``functools.cache`` / ``lru_cache``) are the listed host-only ones.

    reference, primitives  ->  kernels  ->  ops, layouts, autograd  ->  nn  ->  transformers
                        (_autograd_support, autograd_post_norm,   (_hf_families, _hf_forward,
                         autograd_sublayer)                        _hf_fused, _hf_rope)
(``env``, ``_validate``, ``_metadata`` and ``_device`` are leaves any layer may use;
``_quack`` is the only module that imports quack.)"""

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
    # (what every autograd Function shares; the post-norm layer's Functions; the attention
    # sublayer's, before a module of its own)
    "_autograd_support": 2,
    "autograd_post_norm": 2,
    "autograd_sublayer": 2,
    "nn": 3,
    "transformers": 4,
    # (the HF patch's parts: the families it takes, its wrapped forwards, Phi-3's fused keys,
    # the config's and RoPE's rules)
    "_hf_families": 4,
    "_hf_forward": 4,
    "_hf_fused": 4,
    "_hf_rope": 4,
}
LEAVES = {"env", "_validate", "_quack", "_metadata", "_device", "__init__"}
# What each leaf may import from coda (``__init__`` is the package face: it re-exports).
LEAF_IMPORTS = {
    "env": {"_quack", "_validate"},
    "_validate": set(),
    "_quack": {"_metadata", "_device"},
    "_metadata": set(),
    "_device": set(),
}


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


# The plain memos coda keeps, each of host values (a compiled program or launcher, a module,
# a class, a flag): none returns a device tensor. A helper that does goes through
# ``coda.env.host_cache(device_tensors=True)`` or ``TensorMemo``, which a CUDA graph capture
# and a torch.compile trace respect (an ``lru_cache`` of a device tensor built inside a
# capture keeps memory only the graph owns, and Dynamo warns at each one it meets: run 152).
PLAIN_MEMOS = {
    "_quack.py": {"_modules", "scale_a_mod", "_device_scalar"},
    "kernels/_launch.py": {"_compiled_row_kernel"},
    "kernels/_triton.py": {"interpreted", "kernel"},
    "kernels/qk_norm.py": {"qk_norm_rope_program"},
    "primitives/lowering.py": {"lower"},
    "transformers.py": {"patched_class"},
}


def _plain_memo(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    return name in ("cache", "lru_cache")


def test_plain_memos_are_the_listed_host_ones():
    found = {}
    for path in modules():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.FunctionDef) and any(map(_plain_memo, node.decorator_list)):
                found.setdefault(os.path.relpath(path, ROOT), set()).add(node.name)
    assert found == PLAIN_MEMOS, found
