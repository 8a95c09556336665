"""The primitive vocabulary and its torch lowering (the tile interpreter), checked against the
references on float64 tiles with ragged edges; the declarations' own errors; and that a
program using every family lowers and compiles for sm_90a."""

import pytest
import torch
from conftest import random_dims, rel_err

from coda.primitives import (
    ColLoad,
    ColPartials,
    ColSelect,
    OnlineLSE,
    RowLoad,
    RowPartials,
    Scalar,
    TileC,
    TileLoad,
    TileStore,
    epilogue_program,
    exp,
    pack,
    sigmoid,
    unpack,
)
from coda.primitives.interpreter import interpret
from coda.reference.cross_entropy import lse_partials_ref
from coda.reference.rmsnorm import sumsq_partials_ref

F64 = torch.float64


@epilogue_program(
    inputs=[TileC(), RowLoad("g"), ColLoad("s"), TileLoad("t"), Scalar("k")],
    stores=[TileStore("aux")],
    sinks=[
        RowPartials("rsum", scaled=True),
        ColPartials("csum"),
        OnlineLSE("lse"),
        ColSelect("picked", index="idx"),
    ],
)
def every_family(acc, c, g, s, t, k):
    v = (acc + c) * g * s * k
    return {"D": v, "aux": v * t, "rsum": (v, v), "csum": v * t, "lse": v, "picked": v + 1}


@pytest.mark.parametrize("seed", range(3))
def test_interpreter_every_family(seed):
    dims = random_dims(seed, M=(1, 90), N=(1, 150), tm=(1, 40), tn=(1, 48))
    M, N = dims["M"], dims["N"]
    gen = torch.Generator().manual_seed(seed)
    acc, c, t = (torch.randn(M, N, dtype=F64, generator=gen) for _ in range(3))
    g, s = torch.randn(N, dtype=F64, generator=gen), torch.randn(M, dtype=F64, generator=gen)
    idx = torch.randint(-1, N + 1, (M,), generator=gen)  # includes out-of-range rows
    out = interpret(
        every_family,
        acc,
        {"c": c, "g": g, "s": s, "t": t, "idx": idx, "k": -0.3},
        tile_m=dims["tm"],
        tile_n=dims["tn"],
    )
    v = (acc + c) * g * s[:, None] * -0.3
    T_M = -(-M // dims["tm"])
    assert rel_err(out["D"], v) < 1e-14 and rel_err(out["aux"], v * t) < 1e-14
    assert out["rsum"].shape == (M, -(-N // dims["tn"]))
    assert rel_err(out["rsum"], sumsq_partials_ref(v, dims["tn"])) < 1e-13
    assert out["csum"].shape == (T_M, N)
    assert rel_err(out["csum"].sum(0), (v * t).sum(0)) < 1e-13
    assert rel_err(out["lse"], lse_partials_ref(v, dims["tn"])) < 1e-13
    inside = (idx >= 0) & (idx < N)
    want = (v + 1).gather(1, idx.clamp(0, N - 1)[:, None])[:, 0]
    assert torch.equal(out["picked"][inside], want[inside])
    assert out["picked"][~inside].isnan().all()  # never written, as on the GPU


@epilogue_program(inputs=[ColLoad("r")], stores=[TileStore("s")], mode="pair")
def pair_product(acc, r):
    even, odd = unpack(acc * r)
    return {"D": acc, "s": exp(even) * odd}


@epilogue_program(inputs=[TileLoad("cs")], mode="pair")
def swap_scaled(acc, cs):
    x1, x2 = unpack(acc)
    c, s = unpack(cs)
    return {"D": pack(x2 * c, x1 * s)}


@epilogue_program(
    inputs=[TileC(), ColLoad("r")],
    stores=[TileStore("s")],
    sinks=[RowPartials("stat")],
    mode="widen",
)
def widen_split(acc, c, r):
    a, b = unpack(c)
    return {"D": pack(acc * a, acc * sigmoid(b) * r), "s": a - b, "stat": acc * a}


@pytest.mark.parametrize("seed", range(3))
def test_interpreter_pair_and_widen_modes(seed):
    dims = random_dims(seed, M=(1, 70), f=(1, 90), tm=(1, 40), tn=(1, 24))
    M, f, tn = dims["M"], dims["f"], 2 * dims["tn"]
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(M, 2 * f, dtype=F64, generator=gen)
    r = 0.5 + torch.rand(M, dtype=F64, generator=gen)
    # pair: one value per pair of adjacent columns, full-width D untouched
    out = interpret(pair_product, u, {"r": r}, tile_m=dims["tm"], tile_n=tn)
    z = r[:, None] * u
    assert torch.equal(out["D"], u)
    assert rel_err(out["s"], torch.exp(z[:, 0::2]) * z[:, 1::2]) < 1e-14
    # pair tile loads line up with the accumulator's pairs
    cs = torch.randn(M, 2 * f, dtype=F64, generator=gen)
    got = interpret(swap_scaled, u, {"cs": cs}, tile_m=dims["tm"], tile_n=tn)["D"]
    want = torch.stack([u[:, 1::2] * cs[:, 0::2], u[:, 0::2] * cs[:, 1::2]], -1).flatten(1)
    assert rel_err(got, want) < 1e-15
    # widen: one accumulator value per output pair in, a pair out
    ds = torch.randn(M, f, dtype=F64, generator=gen)
    w = interpret(widen_split, ds, {"c": u, "r": r}, tile_m=dims["tm"], tile_n=tn)
    a, b = u[:, 0::2], u[:, 1::2]
    dz = torch.stack([ds * a, ds * torch.sigmoid(b) * r[:, None]], -1).flatten(1)
    assert rel_err(w["D"], dz) < 1e-15 and rel_err(w["s"], a - b) < 1e-15
    assert rel_err(w["stat"].sum(-1), (ds * a).sum(-1)) < 1e-13


def test_interpreter_rounds_outputs_once():
    acc = torch.randn(5, 8, dtype=torch.float32)
    c = torch.randn(5, 8, dtype=torch.float32)
    prog = epilogue_program(inputs=[TileC()])(lambda acc, c: {"D": acc + c})
    out = interpret(prog, acc, {"c": c}, tile_m=4, tile_n=4, out_dtype=torch.bfloat16)
    assert out["D"].dtype == torch.bfloat16 and torch.equal(out["D"], (acc + c).bfloat16())


def test_declaration_errors():
    with pytest.raises(ValueError, match="first parameter must be 'acc'"):
        epilogue_program()(lambda x: {})
    with pytest.raises(ValueError, match="exactly the declared inputs"):
        epilogue_program(inputs=[RowLoad("g")])(lambda acc, h: {})
    with pytest.raises(ValueError, match="duplicate"):
        epilogue_program(inputs=[RowLoad("g")], sinks=[RowPartials("g")])(lambda acc, g: {})
    with pytest.raises(TypeError, match="not an input primitive"):
        epilogue_program(inputs=[TileStore("g")])(lambda acc, g: {})
    with pytest.raises(ValueError, match="mode"):
        epilogue_program(mode="triple")(lambda acc: {})
    with pytest.raises(ValueError, match="widen"):
        epilogue_program(mode="widen")(lambda acc: {})
    prog = epilogue_program()(lambda acc: {"E": acc})
    with pytest.raises(KeyError, match="undeclared"):
        interpret(prog, torch.zeros(2, 2), {}, tile_m=2, tile_n=2)
    with pytest.raises(ValueError, match="even N"):
        interpret(pair_product, torch.zeros(2, 3), {"r": torch.ones(2)}, tile_m=2, tile_n=2)


def test_cache_key_is_plain_and_distinguishes_declarations():
    a = epilogue_program(sinks=[RowPartials("p", scaled=True)])(lambda acc: {"p": (acc, acc)})
    b = epilogue_program(sinks=[RowPartials("p", scaled=False)])(lambda acc: {"p": acc})
    assert hash(a.cache_key()) != hash(b.cache_key())
    assert eval(repr(a.cache_key())) == a.cache_key()  # only plain values


@pytest.mark.compile
def test_every_family_lowers_and_compiles_for_sm90():
    """One program declaring every primitive family lowers through each primitive's own
    ``lower`` / ``host_args`` and compiles for sm_90a (no GPU needed)."""
    from coda.kernels._launch import example_operands, launch
    from coda.kernels.config import DEFAULT

    m, n = 256, 512
    x, w = example_operands(m, 256, n)
    bf = torch.bfloat16
    operands = {
        "g": torch.empty(n, dtype=bf),
        "s": torch.empty(m, dtype=torch.float32),
        "t": torch.empty(m, n, dtype=bf),
        "idx": torch.zeros(m, dtype=torch.int64),
        "k": 0.22,  # (a Python number: a launch argument)
    }
    t_m, t_n = DEFAULT.grid(m, n)
    outputs = {
        "aux": torch.empty(m, n, dtype=bf),
        "rsum": torch.empty(m, t_n),
        "csum": torch.empty(t_m, n),
        "lse": torch.empty(m, t_n),
        "picked": torch.empty(m),
    }
    d, c = torch.empty(m, n, dtype=bf), torch.empty(m, n, dtype=bf)
    compiled = launch(
        every_family, x, w, config=DEFAULT, d=d, c=c, operands=operands, outputs=outputs, dry=True
    )
    assert compiled in (0, 1)


@pytest.mark.parametrize("rows, cols", [(1, None), (64, 1)])
def test_scale_a_expands_as_quacks_strip_layouts(rows, cols):
    """``ScaleA``'s interpreter meaning, element by element, in quack's strip layouts:
    per (row, k-tile) the strip is (K-tiles, M), u[kt, m] scales A[m, kt*64:(kt+1)*64]; per
    (64-row block, column) it is (M / 64, K), u[mb, k] scales A[mb*64:(mb+1)*64, k]."""
    from coda.primitives import ScaleA

    xf = ScaleA("u", rows=rows, cols=cols, tile_k=64)
    M, K = 128, 200  # both strips pad K to whole k-tiles (4 of 64)
    shape = xf.strip_shape(M, K)
    assert shape == ((4, 128) if rows == 1 else (2, 256))
    u = torch.randn(*shape, dtype=torch.float64)
    full = xf.expand(u, M, K)
    for m, k in [(0, 0), (5, 63), (5, 64), (127, 199), (64, 130), (63, 129)]:
        want = u[k // 64, m] if rows == 1 else u[m // 64, k]
        assert full[m, k] == want
    assert xf.kind == ("colvec_ktile" if rows == 1 else "kvec_m64")
    with pytest.raises(ValueError, match="rows, cols"):
        ScaleA("u", rows=2, cols=1)
