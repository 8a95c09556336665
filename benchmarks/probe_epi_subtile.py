"""Probe: does quack's epilogue subtile bound coda's epilogue GEMMs? (session 17, NOTES.md)

quack 0.6.5 picks a 64 x 32 epilogue subtile for a ping-pong 128-row tile and gives coda no
knob for it. This probe forces wider subtiles (64 x 64, 64 x 128) by patching quack's choice
(``GemmSm90._compute_tile_shape_or_override``), each variant in a process of its own with a
quack disk cache of its own (the patch is not part of quack's cache key), and times the 1B
layer's dSwiGLU and gate/up norm-backward GEMMs beside cuBLAS's plain GEMM of each shape; the
sum of |output| beside each time shows whether the variant still computes the same thing.
A measurement of quack's internals, tied to quack 0.6.5; coda itself never patches quack.
    python benchmarks/probe_epi_subtile.py      (on a GPU; writes $OUT/epi_tile_probe.json)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

VARIANTS = [None, 64, 128]  # the subtile's N (None: quack's own choice); M stays quack's


def child(variant):
    import torch

    from benchmarks._common import bench
    from coda import _quack

    _quack._modules()
    import quack.gemm_sm90 as sm90

    if variant is not None:
        own = sm90.GemmSm90._compute_tile_shape_or_override

        def patched(cta, atom, elem=None, override=None):
            if override is not None:
                return override
            return (own(cta, atom, elem, None)[0], variant)

        sm90.GemmSm90._compute_tile_shape_or_override = staticmethod(patched)
    from coda.kernels import dswiglu as dsw
    from coda.kernels import rmsnorm_bwd as nb
    from coda.kernels.config import GemmConfig

    torch.manual_seed(0)
    M, d, f = 16384, 2048, 8192

    def bf(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16)

    dx2, w_d, u = bf(M, d), bf(f, d), bf(M, 2 * f)
    r = torch.rand(M, device="cuda") + 0.5
    dz1, w_il, x1, gm = bf(M, 2 * f), bf(d, 2 * f), bf(M, d), bf(d)
    corr = torch.randn(M, device="cuda")
    cases = [
        (
            "dswiglu",
            GemmConfig(128, 128, 2, 1, True),
            lambda c: dsw.dswiglu_kernel(dx2, w_d, u, r, c),
        ),
        (
            "norm_bwd",
            GemmConfig(128, 192, 2, 1, True),
            lambda c: nb.norm_bwd_kernel(dz1, w_il, x1, gm, corr, dx2, c),
        ),
    ]
    rows = []
    for name, cfg, fn in cases:
        tile = f"{cfg.tile_m}x{cfg.tile_n}/c{cfg.cluster_m}x{cfg.cluster_n}/pp"
        try:
            total = float(fn(cfg)[0].float().abs().sum())
            rows.append(
                {"kernel": name, "cfg": tile, "ms": bench(lambda: fn(cfg))["ms"], "sum": total}
            )
        except Exception as e:  # a subtile quack cannot lay out is recorded
            rows.append({"kernel": name, "cfg": tile, "error": repr(e)[:300]})
        print("ROW", variant, rows[-1], flush=True)
    a, w = bf(M, d), bf(d, f)
    rows.append({"kernel": "cublas_dswiglu_shape", "ms": bench(lambda: a @ w)["ms"]})
    a2, w2 = bf(M, 2 * f), bf(2 * f, d)
    rows.append({"kernel": "cublas_norm_bwd_shape", "ms": bench(lambda: a2 @ w2)["ms"]})
    print("ROWS" + json.dumps({"variant": variant, "rows": rows}), flush=True)


def main():
    results = []
    for v in VARIANTS:
        cache = os.path.join(tempfile.gettempdir(), f"quack_cache_probe_{v}")
        env = dict(os.environ, QUACK_CACHE_DIR=cache)
        try:
            p = subprocess.run(
                [sys.executable, __file__, json.dumps(v)],
                env=env,
                capture_output=True,
                text=True,
                timeout=150,
            )
            stdout, stderr = p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            partial = e.stdout or ""
            stdout = partial.decode() if isinstance(partial, bytes) else partial
            stderr = "timeout"
        lines = stdout.splitlines()
        print("\n".join(x for x in lines if x.startswith("ROW ")), flush=True)
        final = [x for x in lines if x.startswith("ROWS")]
        results.append(
            json.loads(final[0][4:]) if final else {"variant": v, "error": stderr[-1500:]}
        )
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "epi_tile_probe.json"), "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(json.loads(sys.argv[1]))
    else:
        main()
