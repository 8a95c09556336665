"""Probe: does quack's epilogue subtile bound coda's epilogue GEMMs? (session 17, NOTES.md)

quack 0.6.5 picks a 64 x 32 epilogue subtile for a ping-pong 128-row tile and gives coda no
knob for it. This probe forces wider subtiles (64 x 64, 64 x 128) by patching quack's choice
(``GemmSm90._compute_tile_shape_or_override``), each variant in a process of its own with a
quack disk cache of its own (the patch is not part of quack's cache key), and times the 1B
layer's dSwiGLU and gate/up norm-backward GEMMs beside cuBLAS's plain GEMM of each shape.
A measurement of quack's internals, tied to quack 0.6.5; coda itself never patches quack.
    python benchmarks/probe_epi_subtile.py      (on a GPU; writes $OUT/epi_tile_probe.json)
"""
import json, os, subprocess, sys

VARIANTS = [None, 64, 128]

def child(variant):
    import torch
    from benchmarks._common import bench
    from coda import _quack
    _quack._modules()
    import quack.gemm_sm90 as g
    orig = g.GemmSm90._compute_tile_shape_or_override
    if variant is not None:
        def patched(cta, atom, elem=None, override=None):
            if override is not None:
                return override
            base = orig(cta, atom, elem, None)
            return (base[0], variant)
        g.GemmSm90._compute_tile_shape_or_override = staticmethod(patched)
    from coda.kernels import dswiglu as dsw, rmsnorm_bwd as nb
    from coda.kernels.config import GemmConfig
    torch.manual_seed(0)
    M, d, f = 16384, 2048, 8192
    bf = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    dx2, w_d, u = bf(M, d), bf(f, d), bf(M, 2 * f)
    r = torch.rand(M, device="cuda") + 0.5
    dz1, w_il, x1, gm = bf(M, 2 * f), bf(d, 2 * f), bf(M, d), bf(d)
    corr = torch.randn(M, device="cuda")
    rows = []
    cases = [
        ("dswiglu", GemmConfig(128, 128, 2, 1, True), lambda c: dsw.dswiglu_kernel(dx2, w_d, u, r, c)),
        ("norm_bwd", GemmConfig(128, 192, 2, 1, True), lambda c: nb.norm_bwd_kernel(dz1, w_il, x1, gm, corr, dx2, c)),
    ]
    for name, cfg, fn in cases:
        try:
            out = fn(cfg)
            torch.cuda.synchronize()
            t = bench(lambda: fn(cfg))["ms"]
            sig = float(out[0].float().abs().sum())
            rows.append({"kernel": name, "cfg": f"{cfg.tile_m}x{cfg.tile_n}/c{cfg.cluster_m}x{cfg.cluster_n}/{'pp' if cfg.pingpong else 'coop'}", "ms": t, "sum": sig})
            print("ROW", variant, rows[-1], flush=True)
        except Exception as e:
            rows.append({"kernel": name, "cfg": str(cfg), "error": repr(e)[:300]})
    a = bf(M, d); w = bf(d, f)
    rows.append({"kernel": "cublas_dswiglu_shape", "ms": bench(lambda: a @ w)["ms"]})
    a2 = bf(M, 2 * f); w2 = bf(2 * f, d)
    rows.append({"kernel": "cublas_norm_bwd_shape", "ms": bench(lambda: a2 @ w2)["ms"]})
    print("ROWS" + json.dumps({"variant": variant, "rows": rows}), flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        v = json.loads(sys.argv[1])
        child(v)
        sys.exit()
    out = []
    env = dict(os.environ)
    for v in VARIANTS:
        env["QUACK_CACHE_DIR"] = f"/tmp/quack_cache_probe_{v}"
        try:
            p = subprocess.run([sys.executable, __file__, json.dumps(v)], env=env, capture_output=True, text=True, timeout=150)
            stdout, stderr = p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            out_ = e.stdout or ""
            stdout, stderr = (out_.decode() if isinstance(out_, bytes) else out_), "timeout"
        print("\n".join(l for l in stdout.splitlines() if l.startswith("ROW ")), flush=True)
        line = [l for l in stdout.splitlines() if l.startswith("ROWS")]
        res = json.loads(line[0][4:]) if line else {"variant": v, "error": stderr[-1500:]}
        out.append(res)
        for r in res.get("rows", []):
            print(v, r, flush=True)
        if "error" in res:
            print(v, res["error"], flush=True)
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "epi_tile_probe.json"), "w"))
