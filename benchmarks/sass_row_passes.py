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

import os
import re
import subprocess
import sys
import tempfile

import triton.language as tl

from coda.kernels import row_passes as rp
from coda.kernels._triton import cubin_sm90, next_power_of_2

SEQ, TOKENS = 4096, 16384  # the HF benchmark's 4 x 4096 tokens


def step_ints(heads: int, kv_heads: int, head_dim: int) -> dict:
    """The integer arguments both kernels take at the step's call: the token count and the
    (batch, head, seq) strides of dq, dk, dv as cuDNN's attention returns them in the step,
    (B, S, heads, hd) in memory (``probe_row_passes`` recorded them at Qwen3's step, run 102;
    taken alike at Llama's)."""
    out = dict(M=TOKENS, S=SEQ, n_q=heads, n_k=kv_heads)
    for g, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        out.update({f"s{g}b": SEQ * n * head_dim, f"s{g}h": head_dim, f"s{g}s": n * head_dim})
    return out


def _qk_norm_ints(heads: int, kv_heads: int, head_dim: int) -> dict:
    """``step_ints`` and the QK-norm pass's own: z's even and odd halves (row stride, unit
    column stride), the stored v's row stride and the head statistic's."""
    n = heads + 2 * kv_heads
    zs = dict(z_row=(heads + kv_heads) * head_dim // 2, z_col=1, v_row=n * head_dim, s_row=n)
    return {**step_ints(heads, kv_heads, head_dim), **zs}


# kernel -> (its function, head_dim, its integer arguments at the step's call): Qwen3-0.6B's
# QK-norm pass (16 q heads, 8 kv heads, hd 128), Llama-3.2-1B's dRoPE pass (32, 8, 64)
STEP_ARGS = {
    "dqk_norm": (rp._dqk_norm_kernel, 128, _qk_norm_ints(16, 8, 128)),
    "drope": (rp._drope_kernel, 64, step_ints(32, 8, 64)),
}
COUNTED = ("BAR", "LDS", "STS", "SHFL", "LDG", "STG")


def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    folder = os.path.join(os.path.dirname(nv.__file__), "bin")
    return os.path.join(folder, name)


def compiled(name: str, rows: int, warps: int) -> bytes:
    """The cubin of kernel ``name`` at (rows per program, warps), specialized as at the step."""
    fn, hd, ints = STEP_ARGS[name]
    consts = {"HD": hd, "HP": next_power_of_2(hd), "BM": rows, "ACC": tl.float32}
    consts.update({n: 1 for n, v in ints.items() if v == 1})
    divisible = [*rp.POINTERS, *(n for n, v in ints.items() if v % 16 == 0)]
    return cubin_sm90(fn, rp.POINTERS, consts, warps, divisible=divisible)


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
