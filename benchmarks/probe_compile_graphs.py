"""Probe: which model shapes ``torch.compile(model, mode="reduce-overhead")`` captures over
coda's kernel path, each in a child process (a failed capture poisons its process), with the
first error's whole traceback.

Run 144 ran the d=1024 demo model this way after four other peers' steps in the same process
(coda eager, torch.compile with and without its graphs, coda compiled); run 145 failed the
capture of the 1B-shaped one (cudaErrorStreamCaptureInvalidated), and in fresh processes every
shape failed it, at the forward graph's ``capture_end`` (run 146). The cases here
bisect: the model fresh, after two eager steps, with sync warnings on while recording, and
one ``DecoderLayer`` or ``LMHeadLoss`` alone (run 147: only the layer's forward recorded; the
head alone failed as the model did; the layer's case then failed on its input's gradient,
which this probe let accumulate across steps, since fixed), then the head's methods, its row
glue as plain torch and a 512-token head, each with Dynamo's graph count after every step and
its recompile log. The cause, found on the CPU
(session 34): ``fused``'s nested compiled row kernels recompiled at the step CUDA graph trees
record (``coda.kernels._launch``); after the fix the head and the model capture (runs
148-149).

A ``gpu_suite.py`` suite run only when named (``--only compile_graphs``; ``CODA_COMPILE_GRAPHS``
picks cases), or alone: ``python -m benchmarks.probe_compile_graphs [case ...]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

from benchmarks._common import Diagnostic, progress, selected
from benchmarks.bench_step import MODEL_SHAPES, build_model

SUITE = "compile_graphs"
# what each child compiles with mode="reduce-overhead", in a fresh process
CASES = ("model", "model_after_eager_steps", "model_sync_warn", "layer", "lm_head")
# run 147 found the LM head alone failing: its methods, its row glue as plain torch, few tokens
CASES += ("lm_head_chunked", "lm_head_recompute", "lm_head_unfused", "lm_head_512_tokens")


def child(case: str) -> dict:
    import warnings

    import torch

    import coda.nn as cnn

    c = MODEL_SHAPES["demo-d1024"]  # the demo's model, 8 x 1024 tokens
    V, d, B, S = c["vocab"], c["d"], c["batch"], c["seq"]
    torch.manual_seed(0)
    tok = torch.randint(0, V, (B, S), device="cuda")
    x = None  # the layer's and the head's input, a leaf: its gradient dropped every step
    if case == "layer":
        heads = (c["heads"], c["kv_heads"], c["ffn"])
        module = cnn.DecoderLayer(d, *heads, head_dim=c["hd"], device="cuda")
        x = torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        args = (x,)
    elif case.startswith("lm_head"):
        module = cnn.LMHeadLoss(d, V, device="cuda")
        if case in ("lm_head_chunked", "lm_head_recompute"):
            module.method = case.split("_")[-1]
        if case == "lm_head_unfused":  # the row glue as plain torch ops, not torch.compile'd
            import coda.kernels._launch as launch

            launch._compiled_row_kernel = lambda fn: fn
        if case == "lm_head_512_tokens":
            tok = tok[:1, :512]
        x = torch.randn(*tok.shape, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        args = (x, tok)
    else:
        module = build_model(c)
        args = (tok, tok)
    if case == "model_after_eager_steps":
        for _ in range(2):
            module(*args).backward()
    out = {"case": case, "steps": 0, "warnings": [], "graphs_after_step": []}
    compiled = torch.compile(module, mode="reduce-overhead")
    try:
        for i in range(4):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if case == "model_sync_warn" and i == 1:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    y = compiled(*args)
                    (y if y.dim() == 0 else y.float().square().mean()).backward()
                finally:  # a failing step's warnings are the ones wanted
                    torch.cuda.set_sync_debug_mode("default")
                    found = [str(w.message) for w in seen]
                    keep = [m[:300] for m in found if "synchronizing CUDA operation" in m]
                    out["warnings"] += keep
            module.zero_grad(set_to_none=True)
            if x is not None:  # else it accumulates into the last step's graph-owned buffer
                x.grad = None
            torch.cuda.synchronize()
            out["steps"] += 1
            out["graphs_after_step"].append(unique_graphs())
    except Exception:
        out["error"] = traceback.format_exc()[-2500:]
    from torch._dynamo.utils import counters

    out["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    return out


def unique_graphs() -> int:
    """How many graphs Dynamo has compiled in this process (nested row kernels included)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_case(name: str) -> dict:
    """``child(name)`` in a fresh process: its result, or how the process ended."""
    try:
        p = subprocess.run(
            [sys.executable, "-m", "benchmarks.probe_compile_graphs", "--child", name],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the repository
            capture_output=True,
            text=True,
            timeout=110,
            env={**os.environ, "TORCH_LOGS": "recompiles"},
        )
    except subprocess.TimeoutExpired:
        return {"case": name, "error": "timed out (110 s)"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    logged = [ln[-300:] for ln in p.stderr.splitlines() if "ecompil" in ln][-12:]
    if lines:
        return {**json.loads(lines[-1][7:]), "recompiles": logged}
    return {"case": name, "error": f"rc {p.returncode}: {p.stderr[-3000:]}"}


class Suite(Diagnostic):
    """``SUITE`` as a ``gpu_suite.py`` entry: every case, or those in ``CODA_COMPILE_GRAPHS``."""

    def run(self) -> list[dict]:
        names = selected("CODA_COMPILE_GRAPHS", CASES) or CASES
        return [progress({"name": f"{SUITE}/{n}", **run_case(n)}) for n in names]


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":  # else: the cases named, or all
        print("RESULT " + json.dumps(child(sys.argv[2])), flush=True)
        return
    for name in sys.argv[1:] or CASES:
        r = run_case(name)
        print(f"== {name}: {r.get('steps', 0)} steps, skips {r.get('cudagraph_skips')}")
        print("   graphs after each step:", r.get("graphs_after_step"))
        for ln in r.get("recompiles", []):
            print("   ", ln)
        for w in r.get("warnings", [])[:5]:
            print("   sync warning:", w)
        if "error" in r:
            print(r["error"], flush=True)


if __name__ == "__main__":
    main()
