"""What B11's row passes compile to at each launch shape (CPU; no GPU needed).

Compiles ``row_passes._dqk_norm_kernel`` or ``_drope_kernel`` for sm_90a as Triton's JIT
specializes it at a call of the Qwen3-0.6B (or Llama-1B) step (pointers and integer
arguments divisible by 16 where the step's are, an argument equal to 1 made constant), and
counts in the disassembly what separates the launch shapes: registers, barriers, shared
loads and stores, shuffles, global loads and stores, instructions. Session 23 used it to read
why the QK-norm pass runs fastest at one warp (benchmarks/NOTES.md).

    python benchmarks/sass_row_passes.py [dqk_norm|drope]
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from coda.kernels import row_passes as rp

# each kernel's integer arguments at the step's call (M = 4 x 4096 tokens), and its head_dim
STEP_ARGS = {
    "dqk_norm": (
        rp._dqk_norm_kernel,
        128,
        dict(
            M=16384,
            S=4096,
            n_q=16,
            n_k=8,
            z_row=1536,
            z_col=1,
            v_row=4096,
            s_row=32,
            sqb=8388608,
            sqh=128,
            sqs=2048,
            skb=4194304,
            skh=128,
            sks=1024,
            svb=4194304,
            svh=128,
            svs=1024,
        ),
    ),  # fmt: skip
    "drope": (
        rp._drope_kernel,
        64,
        dict(
            M=16384,
            S=4096,
            n_q=32,
            n_k=8,
            sqb=8388608,
            sqh=64,
            sqs=2048,
            skb=2097152,
            skh=64,
            sks=512,
            svb=2097152,
            svh=64,
            svs=512,
        ),
    ),  # fmt: skip
}
COUNTED = ("BAR", "LDS", "STS", "SHFL", "LDG", "STG")


def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    folder = os.path.join(os.path.dirname(nv.__file__), "bin")
    return os.path.join(folder, name)


def compiled(name: str, rows: int, warps: int) -> bytes:
    """The cubin of kernel ``name`` at (rows per program, warps), specialized as at the step."""
    fn, hd, ints = STEP_ARGS[name]
    params = list(inspect.signature(fn).parameters)
    consts = {"HD": hd, "HP": triton.next_power_of_2(hd), "BM": rows, "ACC": tl.float32}
    consts.update({n: 1 for n in params if ints.get(n) == 1})
    sig = {n: "constexpr" if n in consts else rp.POINTERS.get(n, "i32") for n in params}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(params)
        if n not in consts and (n in rp.POINTERS or ints.get(n, 1) % 16 == 0)
    }
    src = ASTSource(fn=triton.jit(fn), signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return k.asm["cubin"]


def counts(cubin: bytes) -> dict:
    """Registers and the counted instructions of one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True)
    lines = [ln for ln in sass.stdout.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    out = {"registers": int(re.search(r"REG:(\d+)", usage).group(1)), "instructions": len(lines)}
    out.update({op: sum(bool(re.search(rf"\b{op}\b", ln)) for ln in lines) for op in COUNTED})
    return out


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "dqk_norm"
    print(f"{name}: rows x warps, " + ", ".join(["registers", "instructions", *COUNTED]))
    for rows, warps in rp.LAUNCH_SHAPES:
        c = counts(compiled(name, rows, warps))
        print(f"{rows:4d} x {warps:<2d}", *(c[k] for k in ("registers", "instructions", *COUNTED)))


if __name__ == "__main__":
    main()
