"""GEMM2 of the attention boundary: QKV projection + deferred row scale + RoPE (KERNELS.md F1).

    acc = a @ W_qkv           a = h * gamma; W_qkv = [q | k | v] columns, q and k per head in
                              the adjacent-pair layout (coda.layouts converts HF weights)
    z   = rstd * acc          VEC-LD COL rstd
    (z_2i, z_2i+1) rotated by theta = pos[m] * inv_freq[i]     EW pairwise
                              VEC-LD COL pos (token positions), VEC-LD ROW freq (per column)
    TILE-ST [q_rot | k_rot | v]   (bf16, M x Nqkv: viewed as (B, S, heads, hd) for attention)

The angle is computed in the epilogue from pos and a per-column float-float frequency table
(inv_freq / 2pi in turns, exact range reduction; quack's angle math), so no (S x hd) table is
read, and V columns carry frequency 0: an exact identity. Supported: bf16, K and Nqkv multiples
of 8, even head_dim; any M. Tests: tests/test_forward_kernels.py.

With a QKV bias (Qwen2's q, k, v projections): z = rstd * acc + bias (VEC-LD ROW bias) before
the rotation, and rstd * acc stored for the backward (``rope_scaled_bias``).

Multimodal RoPE (Qwen2-VL's and Qwen2.5-VL's, ``mrope_scaled_bias``): three position rows
(time, height, width; VEC-LD COL pos, pos_h, pos_w) and each frequency's section, as a
per-column pair of one-hot flags (VEC-LD ROW sect: (1, 0) for height, (0, 1) for width,
(0, 0) for time and for V's columns): the pair's position is pos + on_h (pos_h - pos) +
on_w (pos_w - pos), exact in fp32 for integer positions below 2^24, then the same angle.
"""

from __future__ import annotations

import functools
import math

import torch

from coda.env import TensorMemo, host_cache
from coda.kernels._launch import example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.primitives import ColLoad, RowLoad, TileStore, epilogue_program, pack, unpack
from coda.primitives.math import rotation
from coda.reference.rope import gemm_rope_ref  # noqa: F401  (the op's reference)


def _rotated(z, pos, freq):
    x1, x2 = unpack(z)
    s, c = rotation(pos, freq)
    return pack(x1 * c - x2 * s, x1 * s + x2 * c)


@epilogue_program(inputs=[ColLoad("rstd"), ColLoad("pos"), RowLoad("freq")], mode="pair")
def rope_scaled(acc, rstd, pos, freq):
    return {"D": _rotated(acc * rstd, pos, freq)}


# a QKV projection with a bias (Qwen2): z = rstd * acc + bias, rotated; z without the bias is
# also stored, as its even and odd columns (the backward's norm statistic reads it: the output,
# rounded at the bias's magnitude, would lose what a large bias dwarfs). One program for
# training and for a forward no backward follows, whose z store is clipped to one 16-byte row
# (``gemm_rope_bias_kernel``): the output is then bitwise the training forward's, where two
# programs would let the compiler contract r acc + b into one FMA in one and not the other
@epilogue_program(
    inputs=[ColLoad("rstd"), ColLoad("pos"), RowLoad("freq"), RowLoad("bias")],
    stores=[TileStore("z_even"), TileStore("z_odd")],
    mode="pair",
)
def rope_scaled_bias(acc, rstd, pos, freq, bias):
    z = acc * rstd
    z_even, z_odd = unpack(z)
    return {"D": _rotated(z + bias, pos, freq), "z_even": z_even, "z_odd": z_odd}


def f1_rows(pos, sect):
    """F1's position row and its op's multimodal-RoPE arguments: (pos, ()), or with section
    flags ``sect`` (pos (3, M): the time row, (the height and width rows, sect))."""
    return (pos, ()) if sect is None else (pos[0], (pos[1:], sect))


def mrope_position(pos, pos_h, pos_w, sect):
    """A pair's multimodal-RoPE position: the time row's, or by its section flags (on_h,
    on_w) the height or the width row's (exact: the flags are 0 or 1, the rows integers)."""
    on_h, on_w = unpack(sect)
    return pos + on_h * (pos_h - pos) + on_w * (pos_w - pos)


@epilogue_program(
    inputs=[
        ColLoad("rstd"), ColLoad("pos"), ColLoad("pos_h"), ColLoad("pos_w"), RowLoad("freq"),
        RowLoad("sect"), RowLoad("bias"),
    ],
    stores=[TileStore("z_even"), TileStore("z_odd")],
    mode="pair",
)  # fmt: skip
def mrope_scaled_bias(acc, rstd, pos, pos_h, pos_w, freq, sect, bias):
    """``rope_scaled_bias`` with multimodal RoPE: each pair's position from its section."""
    at = mrope_position(pos, pos_h, pos_w, sect)
    z = acc * rstd
    z_even, z_odd = unpack(z)
    return {"D": _rotated(z + bias, at, freq), "z_even": z_even, "z_odd": z_odd}


def mrope_section_table(sections, rotated_heads: int, plain_heads: int, device=None):
    """``mrope_scaled_bias``'s per-column section flags: for each of ``rotated_heads`` heads,
    pair i holds ([s_i = 1], [s_i = 2]) at columns (2i, 2i+1), ``sections`` (hd/2,) each
    frequency's position row (0 time, 1 height, 2 width); the ``plain_heads`` (V) hold 0."""
    s = torch.as_tensor(sections, device="cpu").long()
    head = torch.stack([(s == 1), (s == 2)], dim=-1).flatten().float()
    plain = torch.zeros(plain_heads * 2 * s.numel())
    return torch.cat([head.repeat(rotated_heads), plain]).to(device)


def rope_freq_table(
    head_dim: int, rotated_heads: int, plain_heads: int, base: float = 10000.0, device=None
) -> torch.Tensor:
    """Per-output-column frequency row for ``rope_scaled``: for each of ``rotated_heads``
    heads, pair i holds inv_freq[i] / 2pi as float32 (hi, lo) at columns (2i, 2i+1); the
    ``plain_heads`` (V) columns hold 0. Length (rotated_heads + plain_heads) * head_dim."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv = base ** (-steps / head_dim)
    return rope_freq_table_from_inv(inv, rotated_heads, plain_heads, device)


def rope_freq_table_from_inv(inv_freq, rotated_heads: int, plain_heads: int, device=None):
    """``rope_freq_table`` from given inverse frequencies (hd/2,): any RoPE whose angle is
    position * inv_freq[i] (Llama 3's scaled frequencies included). Built on the CPU whatever
    the ambient default device (``with torch.device("cuda" | "meta")``), then moved."""
    head_dim = 2 * inv_freq.shape[0]
    turns = inv_freq.double().cpu() / (2 * math.pi)
    hi = turns.to(torch.float32)
    lo = (turns - hi.double()).to(torch.float32)
    head = torch.stack([hi, lo], dim=-1).flatten()
    plain = torch.zeros(plain_heads * head_dim, device="cpu")
    table = torch.cat([head.repeat(rotated_heads), plain])
    return table.to(device=device, dtype=torch.float32)


@host_cache(maxsize=64, device_tensors=True)
def cached_freq_table(head_dim, rotated_heads, plain_heads, base, device) -> torch.Tensor:
    """``rope_freq_table`` built once per configuration and device: building it is a host to
    device copy, which would stall the stream on every call."""
    return rope_freq_table(head_dim, rotated_heads, plain_heads, base, device=device)


def shared_freq_table(inv_freq: torch.Tensor, heads: tuple, device) -> torch.Tensor:
    """``rope_freq_table_from_inv`` for ``inv_freq`` (float64, CPU) and ``heads`` (rotated,
    plain): one tensor for every layer with the same ones, so what is remembered per table
    (the backward's cos/sin, ``drope.cached_head_rotation``) is shared by a stack. Keyed by
    the frequencies' values (their bytes); a torch.compile trace builds it in the graph."""
    if torch.compiler.is_compiling():
        return rope_freq_table_from_inv(inv_freq, *heads, device)
    return _freq_table_of(inv_freq.numpy().tobytes(), *heads, device)


@host_cache(maxsize=64, device_tensors=True)
def _freq_table_of(inv_freq: bytes, rotated_heads: int, plain_heads: int, device):
    inv = torch.frombuffer(bytearray(inv_freq), dtype=torch.float64)
    return rope_freq_table_from_inv(inv, rotated_heads, plain_heads, device)


def _by_context(pos: torch.Tensor, short: torch.Tensor, long: torch.Tensor, long_after: int):
    if pos.numel() == 0:
        return short
    return torch.where(pos.amax() >= long_after, long, short)


# LongRoPE's choice of frequency set (Phi-3.5's, HF's ``longrope``): the ``long`` table for a
# whole call whose largest position reaches ``long_after`` (the original context length),
# else the ``short`` one; decided on the device (no host sync, capturable, traceable) and
# remembered per positions rows, so every layer of a step gets the same table tensor (and
# the backward's cos/sin, remembered per table, are built once a step as without it)
context_freq_table = TensorMemo(_by_context, maxsize=4)


@host_cache(maxsize=16, device_tensors=True)
def default_positions(batch: int, seq: int, device) -> torch.Tensor:
    """The default positions 0..seq-1 of every sequence, as the float32 rows the RoPE epilogue
    reads: built once per (batch, seq, device), not by two kernels in every layer call."""
    return torch.arange(seq, device=device, dtype=torch.float32).repeat(batch)


# positions the epilogue loads as they are (each value converted to float32 in registers as it
# is loaded, exact below 2^24): a caller's int64 / int32 / float32 positions need no cast
LOADED_POSITIONS = (torch.int64, torch.int32, torch.float32)


@functools.partial(TensorMemo, maxsize=2)
def position_rows(positions, batch: int, device) -> torch.Tensor:
    """A caller's integer positions ((batch, seq) or (seq,)) as the float32 token rows the
    RoPE epilogue reads, exact below 2^24. Remembered per positions tensor: every layer of a
    model is given the same one, and its backward's RoPE tables are remembered per these rows
    (``drope.cached_head_rotation``), so a stack builds both once per step, not per layer."""
    flat = positions.reshape(-1).to(device, torch.float32)
    one_sequence = flat.numel() == positions.shape[-1]
    return flat.repeat(batch) if one_sequence and batch > 1 else flat


@functools.partial(TensorMemo, maxsize=2)
def mrope_rows(positions, batch: int, device) -> torch.Tensor:
    """Multimodal RoPE's positions ((3, batch, seq) or (3, 1, seq): time, height, width) as
    the (3, M) float32 rows ``mrope_scaled_bias`` reads, remembered per positions tensor as
    ``position_rows``."""
    rows = positions.reshape(3, -1).to(device, torch.float32)
    if rows.shape[1] != batch * positions.shape[-1]:  # (3, 1, seq): every sequence the same
        rows = rows.repeat(1, batch)
    return rows.contiguous()


@functools.partial(TensorMemo, maxsize=2)
def text_rows(rows: torch.Tensor) -> torch.Tensor:
    """Text alone in a multimodal-RoPE layer: one set of position rows (M,) as all three
    (3, M), remembered per rows (one tensor for every layer of a step, as the others)."""
    return rows[None].expand(3, -1).contiguous()


def gemm_rope_kernel(a, w_qkv, rstd, pos, freq, config: GemmConfig = DEFAULT, dry=False):
    """Returns qkv (M x Nqkv, rotated q and k, plain v); with ``dry`` only compiles."""
    qkv = a.new_empty(a.shape[0], w_qkv.shape[1])
    operands = {"rstd": rstd, "pos": pos, "freq": freq}
    compiled = launch(rope_scaled, a, w_qkv, config=config, d=qkv, operands=operands, dry=dry)
    return compiled if dry else qkv


# z's columns a forward without backward keeps (its z store clipped to one 16-byte row)
LEAN_Z_COLS = 16


def gemm_rope_bias_kernel(
    a, w_qkv, rstd, pos, freq, bias, config=DEFAULT, z_cols=None, dry=False, mrope=None
):
    """``gemm_rope_kernel`` with a per-column ``bias`` (Nqkv,) added before the rotation.
    Returns (qkv, z_even, z_odd): z = rstd * acc without the bias, the even and odd columns of
    its first ``z_cols`` columns (default all Nqkv, what ``drope_bias_heads`` reads; on the GPU
    a multiple of 16, for the TMA's 16-byte rows: the store clips the tiles past it).
    ``mrope``: (pos_h, pos_w, sect), multimodal RoPE's height and width rows and section
    flags (``mrope_section_table``); ``pos`` is then the time row."""
    M, N = a.shape[0], w_qkv.shape[1]
    z_cols = N if z_cols is None else z_cols
    assert 0 < z_cols <= N and z_cols % 2 == 0, z_cols
    qkv = a.new_empty(M, N)
    operands = {"rstd": rstd, "pos": pos, "freq": freq, "bias": bias}
    program = rope_scaled_bias
    if mrope is not None:
        operands.update(zip(("pos_h", "pos_w", "sect"), mrope))
        program = mrope_scaled_bias
    outputs = {"z_even": a.new_empty(M, z_cols // 2), "z_odd": a.new_empty(M, z_cols // 2)}
    compiled = launch(
        program,
        a,
        w_qkv,
        config=config,
        d=qkv,
        operands=operands,
        outputs=outputs,
        dry=dry,
    )
    return compiled if dry else (qkv, outputs["z_even"], outputs["z_odd"])


def lean_z_cols(n_cols: int) -> int:
    """The z columns F1 with a bias keeps where no backward follows: one 16-byte row."""
    return min(LEAN_Z_COLS, n_cols)


def gemm_rope_interpreted(a, w_qkv, rstd, pos, freq, config: GemmConfig = DEFAULT):
    operands = {"rstd": rstd, "pos": pos, "freq": freq}
    return interpret_gemm(rope_scaled, a, w_qkv, config=config, operands=operands)["D"]


def compile_gemm_rope(k, n, *, w_major="n", config=DEFAULT, m=256, pos_dtype=torch.float32) -> int:
    a, w = example_operands(m, k, n, w_major)
    pos = torch.zeros(m, dtype=pos_dtype)
    return gemm_rope_kernel(a, w, torch.empty(m), pos, torch.empty(n), config, dry=True)


def compile_gemm_rope_bias(
    k, n, *, z_cols=None, w_major="n", config=DEFAULT, m=256, pos_dtype=torch.float32,
    mrope=False,
) -> int:  # fmt: skip
    a, w = example_operands(m, k, n, w_major)
    pos, r, f = torch.zeros(m, dtype=pos_dtype), torch.empty(m), torch.empty(n)
    b = torch.empty(n, dtype=a.dtype)
    rows = (torch.zeros(m), torch.zeros(m), torch.zeros(n)) if mrope else None
    return gemm_rope_bias_kernel(a, w, r, pos, f, b, config, z_cols=z_cols, dry=True, mrope=rows)
