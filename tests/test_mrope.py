"""Multimodal RoPE (Qwen2-VL's and Qwen2.5-VL's: each frequency's angle from one of three
position rows, time, height and width) on coda's layer: F1's ``mrope_scaled_bias`` through the
tile interpreter equals its float64 definition; ``DecoderLayer(mrope_sections=)``'s kernel path
(F1 and B11's rotation tables, ``drope.mrope_head_rotation``) equals its reference path,
forward and every gradient, float64, with rows that differ; text alone (one row for all
three) is plain RoPE; the arguments are checked. (The sm_90a compiles:
``test_forward_kernels.COMPILES["rope_bias_mrope"]``, ``test_tuned``; the symbolic proof:
``test_symbolic``; Hugging Face's models: ``test_transformers_vlm``.)"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import coda.env
from coda import _validate as v
from coda.kernels import gemm_rope as rp
from coda.kernels.config import DEFAULT
from coda.nn import DecoderLayer
from coda.reference import rope as rope_ref

F64 = torch.float64


def _rows(B: int, S: int, seed: int) -> torch.Tensor:
    """(3, B, S) positions as Qwen2-VL's: text runs on all three rows, an image's tokens
    on one time step with a height x width grid."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S).repeat(3, B, 1)
    for b in range(B):
        start = int(torch.randint(0, S - 6, (1,), generator=g))
        grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij"))
        pos[0, b, start : start + 6] = start
        pos[1:, b, start : start + 6] = start + grid.reshape(2, 6)
        pos[:, b, start + 6 :] = torch.arange(start + 3, start + 3 + S - start - 6)
    return pos


def test_mrope_program_equals_its_definition_float64():
    g = torch.Generator().manual_seed(0)
    M, K, H, Hkv, hd = 37, 16, 2, 1, 12
    N = (H + 2 * Hkv) * hd
    x, w = torch.randn(M, K, dtype=F64, generator=g), torch.randn(K, N, dtype=F64, generator=g)
    r, b = torch.rand(M, dtype=F64, generator=g) + 0.5, torch.randn(N, dtype=F64, generator=g)
    pos3 = _rows(1, M, seed=1).reshape(3, M).to(F64)
    sections = torch.tensor([0, 0, 1, 1, 2, 2])
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=F64) / hd)
    freq = rp.rope_freq_table_from_inv(inv, H + Hkv, Hkv).to(F64)
    sect = rp.mrope_section_table(sections, H + Hkv, Hkv).to(F64)
    qkv, z_even, z_odd = rp.gemm_rope_bias_kernel(
        x, w, r, pos3[0], freq, b, DEFAULT, mrope=(pos3[1], pos3[2], sect)
    )
    ang = pos3.index_select(0, sections).t() * inv
    cs = torch.stack([ang.cos(), ang.sin()], dim=-1).flatten(1)
    want = rope_ref.gemm_rope_ref(x, w, r, cs, H, Hkv, hd, b)
    assert rel_err(qkv, want) < 1e-12
    z = r[:, None] * (x @ w)
    assert rel_err(z_even, z[:, 0::2]) < 1e-12 and rel_err(z_odd, z[:, 1::2]) < 1e-12


def _layer(seed: int, sections):
    torch.manual_seed(seed)
    layer = DecoderLayer(
        48, 4, 2, 64, head_dim=12, dtype=F64, qkv_bias=True, mrope_sections=sections
    )
    with torch.no_grad():  # (q . k of a few units: attention far from uniform)
        layer.w_qkv.normal_(0.0, 0.5)
        layer.bias_qkv.normal_()
        layer.attention_norm.add_(0.1 * torch.randn(48, dtype=F64))
    return layer


def _step(layer, x, pos):
    for p in layer.parameters():
        p.grad = None
    xi = x.clone().requires_grad_(True)
    y = layer(xi, positions=pos)
    (y * torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)).sum().backward()
    return [y.detach(), xi.grad] + [p.grad for p in layer.parameters()]


def _assert_kernel_path_equals_reference(layer, x, pos, monkeypatch):
    """The layer's kernel path (the interpreter) equals its reference path, output and every
    gradient; and the rows matter: the time row alone for all three is another layer's (its
    branches' output, past the residual, differs)."""
    want = _step(layer, x, pos)
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    coda.env._LAST.clear()
    got = _step(layer, x, pos)
    assert coda.last_path("DecoderLayer")[0] == "kernel"
    for a, e in zip(got, want):
        assert rel_err(a, e) < 1e-10
    plain = _step(layer, x, pos[0])
    assert rel_err(plain[0] - x, want[0] - x) > 1e-2


@pytest.mark.parametrize("B,S", [(2, 13), (1, 21)])
def test_mrope_layer_kernel_path_equals_reference_float64(B, S, monkeypatch):
    layer = _layer(0, [0, 0, 1, 1, 2, 2])
    x = torch.randn(B, S, 48, dtype=F64)
    _assert_kernel_path_equals_reference(layer, x, _rows(B, S, seed=B), monkeypatch)


@pytest.mark.parametrize("head_dim", [32, 12], ids=["epilogue", "row_pass"])
def test_mrope_with_qk_norm_kernel_path_equals_reference_float64(head_dim, monkeypatch):
    """Qwen3-VL's layer: QK-norm and multimodal RoPE in F1's epilogue (head_dim 32: a tile
    holds whole heads) or in the row pass after it (head_dim 12), and the backward's."""
    half = head_dim // 2
    sections = [i % 3 for i in range(half)]  # (Qwen3-VL's interleaved order)
    torch.manual_seed(3)
    kw = dict(head_dim=head_dim, dtype=F64, qk_norm=True, mrope_sections=sections)
    layer = DecoderLayer(48, 4, 2, 64, **kw)
    with torch.no_grad():
        layer.w_qkv.normal_(0.0, 0.5)
        layer.q_norm.add_(0.3 * torch.randn(head_dim, dtype=F64))
    x = torch.randn(2, 13, 48, dtype=F64)
    _assert_kernel_path_equals_reference(layer, x, _rows(2, 13, seed=5), monkeypatch)


def test_text_alone_is_plain_rope(monkeypatch):
    """One (batch, seq) row for all three: the same as a layer without sections, and the
    same (3, M) rows tensor on every call with those positions."""
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    layer = _layer(1, [0, 1, 2, 0, 1, 2])
    plain = _layer(1, None)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 48, dtype=F64)
    pos = torch.arange(9).repeat(2, 1) + 3
    for a, e in zip(_step(layer, x, pos), _step(plain, x, pos)):
        assert rel_err(a, e) < 1e-12
    # the three rows built once for the positions, as the plain rows are (every layer of a
    # step the same tensor, so its backward's tables are remembered, not rebuilt per layer)
    dev = torch.device("cpu")
    assert layer._positions(pos, 2, 9, dev) is layer._positions(pos, 2, 9, dev)


def test_mrope_arguments_are_checked():
    with pytest.raises(v.CodaInputError, match="mrope_sections: expected head_dim / 2 = 6"):
        _layer(0, [0, 1, 2])
    with pytest.raises(v.CodaInputError, match="mrope_sections: expected head_dim / 2 = 6"):
        _layer(0, [0, 1, 2, 3, 0, 0])
    with pytest.raises(v.CodaInputError, match="supported with qkv_bias .* or qk_norm"):
        DecoderLayer(48, 4, 2, 64, head_dim=12, mrope_sections=[0] * 6)
    layer = _layer(0, [0] * 6)
    with pytest.raises(v.CodaInputError, match=r"positions: expected integer \(3, batch, seq\)"):
        layer(torch.randn(2, 5, 48, dtype=F64), positions=torch.zeros(3, 2, 4, dtype=torch.long))
