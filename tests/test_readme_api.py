"""The README's Python examples call the API as it is: every call rooted at ``coda`` names an
object that exists and binds its arguments (their count and keyword names) to that object's
signature; so does a call of a method or of an instance of a coda class the example made
(``layer = coda.nn.DecoderLayer(...)`` then ``layer.load_hf_state_dict(...)``, ``head(x, t)``).
The examples use CUDA shapes too large to run here; binding is what a rename would break."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _chain(node) -> list[str] | None:
    """``coda.nn.DecoderLayer`` as ["coda", "nn", "DecoderLayer"]; None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


def _resolve(chain: list[str]):
    """The object a ``coda...`` chain names (importing submodules on the way)."""
    obj = importlib.import_module("coda")
    for i, name in enumerate(chain[1:], 1):
        if not hasattr(obj, name):
            importlib.import_module(".".join(chain[: i + 1]))
        obj = getattr(obj, name)
    return obj


def _method_signature(cls, method: str):
    """The signature a call of an instance's ``method`` binds to (``self`` dropped)."""
    signature = inspect.signature(getattr(cls, method))
    params = list(signature.parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return signature.replace(parameters=params)


def check_calls(source: str) -> list[str]:
    """Every call of ``source`` that does not bind to the coda object it names."""
    tree = ast.parse(source)
    made = {}  # variable -> coda class it was made from
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            chain = _chain(node.value.func)
            if chain and chain[0] == "coda" and inspect.isclass(_resolve(chain)):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        made[target.id] = _resolve(chain)
    failures = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        chain = _chain(node.func)
        if not chain:
            continue
        if chain[0] == "coda":
            try:
                signature = inspect.signature(_resolve(chain))
            except (AttributeError, ImportError) as e:
                failures.append(f"{'.'.join(chain)}: {e}")
                continue
        elif chain[0] in made and len(chain) <= 2:
            cls = made[chain[0]]
            call = "forward" if hasattr(cls, "forward") else "__call__"  # an nn.Module's call
            method = chain[1] if len(chain) == 2 else call
            if not hasattr(cls, method):
                failures.append(f"{'.'.join(chain)}: {cls.__name__} has no {method}")
                continue
            signature = _method_signature(cls, method)
        else:
            continue
        args = [object()] * len(node.args)
        kwargs = {k.arg: object() for k in node.keywords if k.arg is not None}
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            failures.append(f"line {node.lineno}, {'.'.join(chain)}: {e}")
    return failures


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_binds_to_the_api(index):
    source = BLOCKS[index]
    if "coda.transformers" in source:
        pytest.importorskip("transformers")
    assert check_calls(source) == []


def test_the_readme_has_examples_and_the_checker_catches_a_bad_call():
    """The checker sees the README's calls (a parser that found none would pass) and fails a
    misspelt keyword, a missing name, a method a class lacks and an extra positional."""
    assert len(BLOCKS) >= 4 and sum(s.count("coda.") for s in BLOCKS) >= 15
    bad = (
        "import coda, coda.nn\n"
        "layer = coda.nn.DecoderLayer(d=64, n_heads=2, n_kv_heads=1, ffnn=128)\n"
        "coda.gemm_no_such_op(x)\n"
        "layer.load_weights(sd)\n"
        "head = coda.nn.LMHeadLoss(d=64, vocab=256)\n"
        "head(x, t, 1, 2, 3, 4, 5)\n"
    )
    failures = check_calls(bad)
    assert len(failures) == 4, failures
    assert "'ffn'" in failures[0] and "gemm_no_such_op" in failures[1], failures
