"""Cross-entropy backward through the LM head, CE-A: recompute the logits tile by tile
(KERNELS.md section 4, B1 + A4 + B2 + A5 + B3), chunked over the vocabulary.

For each vocabulary chunk C (the logits are never stored, dz~ only one chunk at a time):
    B1  acc = a @ W_lm[:, C]                     the forward's GEMM, recomputed
        p = exp(rstd * acc - lse) * scale        VEC-LD COL rstd, lse, scale = g * w[m]
        D = dz~ = rstd * p                       TILE-ST bf16 (M x |C|)
        S[m, t] = sum p * acc                    RED_m, the final norm's statistic
        then one element per row: dz~[m, y_m] -= rstd * scale,  S -= scale * acc[m, y_m]
        (the one-hot term: rows whose target falls in C; acc[m, y_m] = l_y / rstd from F6)
    B3  dW_lm[:, C] = a^T @ dz~                  complete per chunk, stored into its column
                                                 block of dW_lm (no fp32 d x V buffer, and
                                                 no transposed copy afterwards)
    B2  G += dz~ @ W_lm[:, C]^T                  fp32 M x d accumulator
AUX:  corr = -(rstd^3 / d) * sum S;  dh = gamma * G + corr * h;  dgamma = sum_m G * h
(the last step is elementwise over M x d; ``rmsnorm_bwd`` holds the epilogue form.)

With a logit soft-cap c (``capped_softmax_grad_logits``): p = exp(z - lse) of the capped
z = c tanh(l / c), every entry's gradient times dz/dl = 1 - tanh^2 = 4 s (1 - s) with
s = sigmoid(2 l / c); the target entry's likewise (``_one_hot_fixup``, from F6's uncapped
target logit).

Peak extra memory: M |C| 2 bytes (dz~) + M d 4 bytes (G). Tests: tests/test_backward_kernels.py.
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._launch import acc_dtype, example_operands, fused, interpret_gemm, launch
from coda.kernels._triton import cdiv, compile_sm90, contiguous_pass, kernel
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.linear_cross_entropy import capped_with_slope
from coda.kernels.loss_rows import ce_row_weights
from coda.kernels.tuned import config_for
from coda.primitives import ColLoad, RowPartials, epilogue_program, exp, sigmoid
from coda.primitives.aux import combine_row_partials, norm_correction


@epilogue_program(
    inputs=[ColLoad("rstd"), ColLoad("lse"), ColLoad("scale")], sinks=[RowPartials("stat")]
)
def softmax_grad_logits(acc, rstd, lse, scale):
    p = exp(acc * rstd - lse) * scale
    return {"D": p * rstd, "stat": p * acc}


@epilogue_program(
    inputs=[ColLoad("rstd"), ColLoad("lse"), ColLoad("scale"), ColLoad("shift")],
    sinks=[RowPartials("stat")],
)
def softmax_grad_logits_shifted(acc, rstd, lse, scale, shift):
    """Label smoothing's uniform term in the same pass: dl = p * scale - shift, with
    shift = scale_m * eps / V per row (formed in fp32 and rounded once, as PyTorch's)."""
    dl = exp(acc * rstd - lse) * scale - shift
    return {"D": dl * rstd, "stat": dl * acc}


@epilogue_program(
    inputs=[ColLoad("rstd"), ColLoad("lse"), ColLoad("scale"), ColLoad("cap")],
    sinks=[RowPartials("stat")],
)
def capped_softmax_grad_logits(acc, rstd, lse, scale, cap):
    """The soft-capped logits' gradient: tanh(l / c) = 2 s - 1 with s = sigmoid(2 l / c),
    dl = scale * exp(c tanh(l / c) - lse) * 4 s (1 - s)."""
    s = sigmoid(acc * rstd * (2.0 / cap))
    dl = exp(cap * (2.0 * s - 1.0) - lse) * scale * (4.0 * s * (1.0 - s))
    return {"D": dl * rstd, "stat": dl * acc}


def row_scale(target, ignore_index, reduction, grad):
    """scale[m] = g * w[m]: w = 1/M_valid ("mean") or 1 ("sum") on valid rows, 0 elsewhere;
    ``grad`` is a 0-d tensor or a per-row tensor (reduction "none")."""
    dt = torch.promote_types(grad.dtype, torch.float32)
    return ce_row_weights(target, ignore_index, reduction, dt) * grad.to(dt)


def ce_grad_weights(scale, lse, vocab: int, label_smoothing: float, z_loss: float):
    """The three per-row weights of dl = scale_p * p - hot * onehot - shift for CE with
    z-loss z and label smoothing eps: scale_p = scale (1 + 2 z lse), hot = scale (1 - eps),
    shift = scale eps / V (None without smoothing)."""
    p_scale = scale * (1.0 + 2.0 * z_loss * lse) if z_loss else scale
    hot = scale * (1.0 - label_smoothing) if label_smoothing else scale
    shift = scale * (label_smoothing / vocab) if label_smoothing else None
    return p_scale, hot, shift


def _one_hot_fixup(
    dz, stat_sum, target, col0, rstd, scale, hot, target_logit, lse, shift, cap=None
):
    """The one-hot term for rows whose target lies in this chunk: the target entry of dz~ is
    rewritten as rstd * (scale * p_y - hot - shift), formed in fp32 and rounded once (p_y =
    exp(l_y - lse) from F6's target logit: the same value the epilogue computed; ``hot`` is the
    one-hot weight, scale * (1 - eps) with label smoothing; ``shift`` the uniform term, or
    None; with a soft-cap ``cap`` c, p_y = exp(z_y - lse) and the whole entry times
    1 - tanh^2(l_y / c)). Adding
    -rstd * hot to the stored bf16 entry instead would round the row's largest entry three
    times. Each row writes one value (its own, where the target is elsewhere): no host sync,
    no collision, deterministic."""
    n = dz.shape[1]
    local = target - col0
    inside = (local >= 0) & (local < n)
    idx = local.clamp(0, n - 1)[:, None]
    if cap is None:
        z, slope = target_logit, 1.0
    else:
        z, slope = capped_with_slope(target_logit, cap)
    exact = scale * torch.exp(z - lse) - hot
    exact = rstd * slope * (exact if shift is None else exact - shift)
    dz.scatter_(
        1, idx, torch.where(inside[:, None], exact.to(dz.dtype)[:, None], dz.gather(1, idx))
    )
    stat_sum -= torch.where(inside, slope * hot * target_logit / rstd, torch.zeros_like(scale))


def grad_logits_chunk(
    a, w_chunk, rstd, lse, scale, config: GemmConfig = DEFAULT, dry=False, shift=None, cap=None
):
    """B1 on one vocabulary chunk: returns (dz~ chunk, per-row S without the one-hot term).
    ``shift`` (per row, label smoothing's uniform term) selects the shifted program, ``cap``
    (per row, every entry the soft-cap c) the capped one (not both)."""
    M, n = a.shape[0], w_chunk.shape[1]
    dz = a.new_empty(M, n)
    stat = a.new_empty(M, config.grid(M, n)[1], dtype=acc_dtype(a))
    operands = {"rstd": rstd, "lse": lse, "scale": scale}
    program = softmax_grad_logits
    if shift is not None:
        operands["shift"], program = shift, softmax_grad_logits_shifted
    if cap is not None:
        assert shift is None, "label smoothing with a soft-cap: refused before this"
        operands["cap"], program = cap, capped_softmax_grad_logits
    compiled = launch(
        program,
        a,
        w_chunk,
        config=config,
        d=dz,
        operands=operands,
        outputs={"stat": stat},
        dry=dry,
    )
    return compiled if dry else (dz, combine_row_partials(stat))


@epilogue_program()
def passthrough(acc):
    return {"D": acc}


def linear_cross_entropy_bwd_kernel(
    a,
    w_lm,
    rstd,
    lse,
    target_logit,
    target,
    scale,
    chunk: int = 16384,
    config: GemmConfig = DEFAULT,
    interpreted: bool = False,
    hot=None,
    shift=None,
    want_dw: bool = True,
    softcap: float | None = None,
):
    """Returns (G = dz~ @ W_lm^T fp32 M x d, S per row fp32, dW_lm d x V in w_lm's layout
    (``vocab_rows``: a view of (V, d) rows, else row-major); without ``want_dw``, a frozen
    weight, no B3 GEMM and an empty (d, 0) dW_lm).
    ``chunk`` columns of dz~ are live at a time. ``interpreted`` runs B1 through the
    tile interpreter and B2/B3 in torch (the CPU oracle of the same loop). ``scale`` weighs
    the softmax term, ``hot`` (default ``scale``) the one-hot term, ``shift`` (default none)
    is subtracted from every entry: z-loss and label smoothing (``ce_grad_weights``).
    ``softcap``: the logits' soft-cap c (``lse`` over the capped logits, ``target_logit``
    uncapped), or None."""
    hot = scale if hot is None else hot
    (M, d), V = a.shape, w_lm.shape[1]
    cap = None if softcap is None else lse.new_full((M,), softcap)  # (the epilogue's operand)
    chunk = -(-chunk // 8) * 8  # every dW column block starts 16-byte aligned for the TMA
    G = a.new_zeros(M, d, dtype=acc_dtype(a) if not interpreted else a.dtype)
    S = a.new_zeros(M, dtype=G.dtype)
    # dW in w_lm's own storage: (V, d) rows for the (d, V) view of an ``nn.Linear``-style
    # (V, d) weight (LMHeadLoss's, HF's), whose gradient then leaves without a transposing
    # copy (run 290: 0.45 ms at d = 2048, V = 32768; 3.9 ms at d = 4096, V = 128256)
    rows = want_dw and vocab_rows(w_lm)
    dw = a.new_empty(V, d) if rows else a.new_empty(d, V if want_dw else 0)
    for c0 in range(0, V, chunk):
        wc = w_lm[:, c0 : c0 + chunk]
        if interpreted:
            dz, s = grad_logits_interpreted(a, wc, rstd, lse, scale, config, shift, cap)
        else:
            dz, s = grad_logits_chunk(a, wc, rstd, lse, scale, config, shift=shift, cap=cap)
        _one_hot_fixup(dz, s, target, c0, rstd, scale, hot, target_logit, lse, shift, softcap)
        S += s
        if rows:  # B3: dW_lm^T[C, :] = dz~^T @ a, stored straight into its row block
            n = dz.shape[1]
            cfg = config_for("passthrough", V, M, d)
            launch(passthrough, dz.t(), a, config=cfg, d=dw[c0 : c0 + n])
        elif want_dw:  # B3: dW_lm[:, C] = a^T @ dz~, stored straight into its column block
            launch(
                passthrough,
                a.t(),
                dz,
                config=config_for("passthrough", d, M, V),
                d=dw[:, c0 : c0 + dz.shape[1]],
            )
        if interpreted:
            G += dz @ wc.t()
        else:  # B2: G += dz~ @ W_c^T, reduce-added by the TMA store into the fp32 G
            launch(passthrough, dz, wc.t(), config=config, d=G, add_to_output=True)
        del dz  # (before the next chunk's is made: M x chunk bf16, 0.5 GiB at M = 16384)
    return G, S, (dw.t() if rows else dw)


def vocab_rows(w_lm) -> bool:
    """Whether the (d, V) LM-head weight ``w_lm`` is a view of (V, d) row-major storage
    (``nn.Linear``'s layout): then its gradient is formed in that storage."""
    return not w_lm.is_contiguous() and w_lm.t().is_contiguous()


def final_norm_bwd(G, S, h, gamma, rstd):
    """AUX A4 + the B2 epilogue as one elementwise pass: returns (dh bf16, dgamma fp32)."""
    corr = norm_correction(rstd, S, h.shape[1])
    hf = h.to(G.dtype)
    dh = torch.addcmul(G * gamma.to(G.dtype), corr[:, None], hf)
    return dh.to(h.dtype), (G * hf).sum(0)


def final_norm_bwd_normed(G, S, h, gamma, rstd):
    """``final_norm_bwd`` when the LM head's A operand was the normed y = h * rstd * gamma
    (rstd applied before the GEMM, not deferred): then G = dl @ W^T = dy and S = rstd * the
    deferred form's statistic, so both are converted in the same elementwise pass."""
    return final_norm_bwd(G * rstd[:, None].to(G.dtype), S / rstd, h, gamma, rstd)


def final_norm_bwd_normed_scaled(G, S, h, gamma, rstd, g):
    """``final_norm_bwd_normed`` of the gradients G, S formed at an upstream gradient of 1,
    for the true upstream gradient ``g`` (0-d): the pass is linear in (G, S), so g enters in
    fp32 before the one rounding to h's dtype (no second rounding, whatever g is)."""
    g = g.to(G.dtype)
    return final_norm_bwd_normed(G * g, S * g, h, gamma, rstd)


def _scaled_cast(acc, g, dtype):
    return (acc * g.to(acc.dtype)).to(dtype).contiguous()


def _scaled_cast_kernel(acc, g, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    a = tl.load(acc + offs, mask=live)
    # one product in acc's dtype, rounded once to out's (to nearest even on the GPU, as torch;
    # Triton's interpreter truncates instead)
    tl.store(out + offs, (a * tl.load(g).to(a.dtype)).to(out.dtype.element_ty), mask=live)


CAST_BLOCK = 4096  # elements per program: 16 a thread at 8 warps, four 16-byte loads of fp32


def scaled_cast_triton(acc, g, dtype):
    """``_scaled_cast`` of a contiguous ``acc`` by a one-element ``g`` on its device, as one
    Triton launch whose tile is fixed here. Through ``fused`` (Inductor, dynamic shapes) the
    same pass ran at 3.4 TB/s against this kernel's 4.3 (0.93 against 0.74 ms at d = 4096,
    V = 128256; 0.148 against 0.105 at d = 2048, V = 32768: run 170), and its launch config
    is Inductor's to choose, once, at the first call (in run 169 it profiled at 2.05 ms after
    the host benchmark's small head had run first; benchmarks/NOTES.md, session 39)."""
    out = torch.empty_like(acc, dtype=dtype)
    n = acc.numel()
    if n:
        grid = (cdiv(n, CAST_BLOCK),)
        kernel(_scaled_cast_kernel)[grid](acc, g, out, n, BLOCK=CAST_BLOCK, num_warps=8)
    return out


def compile_scaled_cast(arch: int = 90) -> int:
    """The cast kernel (fp32 accumulator, bf16 gradient) compiled for ``sm_{arch}`` on the
    CPU: its cubin's size."""
    pointers = {"acc": "*fp32", "g": "*fp32", "out": "*bf16"}
    return compile_sm90(_scaled_cast_kernel, pointers, {"BLOCK": CAST_BLOCK}, 8, arch)


def _cast_pass(acc, g, dtype):
    """``_scaled_cast`` where ``acc`` is contiguous: the Triton pass on its device (outside a
    torch.compile trace, which fuses the torch form instead), else the torch form."""
    if contiguous_pass(acc) and g.numel() == 1 and g.device == acc.device:
        return scaled_cast_triton(acc, g, dtype)
    return fused(_scaled_cast)(acc, g, dtype)


def weight_grad_from_acc(acc, g, like):
    """``g * acc`` rounded once to ``like``'s dtype, in ``like``'s layout: the LM head's
    weight gradient from its fp32 accumulator (formed at an upstream gradient of 1), one
    pass on the GPU in whichever orientation ``like`` is contiguous (``_cast_pass``).
    ``LMHeadLoss``'s and HF's (V, d) ``weight.t()`` view runs on both tensors' contiguous
    (V, d) storage (torch's own mul into a bf16 ``out`` took 1.30 ms in the HF Llama-1B step,
    Inductor's pass 0.54: runs 21, 27); a (d, V)-contiguous weight against CE-S's (V, d)
    accumulator is a transposing pass (Inductor: 3.07 ms against 1.04 at d = 4096,
    V = 128256: run 54). Any other layout: a copy."""
    if like.is_contiguous():
        return _cast_pass(acc, g, like.dtype)
    if like.t().is_contiguous():
        return _cast_pass(acc.t(), g, like.dtype).t()
    return torch.empty_like(like).copy_(acc * g.to(acc.dtype))


def grad_logits_interpreted(
    a, w, rstd, lse, scale, config: GemmConfig = DEFAULT, shift=None, cap=None
):
    operands = {"rstd": rstd, "lse": lse, "scale": scale}
    program = softmax_grad_logits
    if shift is not None:
        operands["shift"], program = shift, softmax_grad_logits_shifted
    if cap is not None:
        operands["cap"], program = cap, capped_softmax_grad_logits
    out = interpret_gemm(program, a, w, config=config, operands=operands)
    return out["D"], combine_row_partials(out["stat"])


def compile_grad_logits(
    d, v, *, w_major="n", config=DEFAULT, m=256, shifted=False, capped=False
) -> int:
    a, w = example_operands(m, d, v, w_major)
    e = torch.empty(m)
    shift, cap = (e if shifted else None), (e if capped else None)
    return grad_logits_chunk(a, w, e, e, e, config, dry=True, shift=shift, cap=cap)


def compile_dw_block(d, v, *, chunk=512, m=256) -> int:
    """B3 into a column block of a row-major dW (d x V): D is a strided view."""
    a = torch.empty(m, d, dtype=torch.bfloat16)
    dz = torch.empty(m, chunk, dtype=torch.bfloat16)
    dw = torch.empty(d, v, dtype=torch.bfloat16)
    cfg = config_for("passthrough", d, m, v)
    return launch(passthrough, a.t(), dz, config=cfg, d=dw[:, chunk : 2 * chunk], dry=True)


def compile_accumulate(v, d, *, config=DEFAULT, m=256) -> int:
    """The B2 accumulation: fp32 G += bf16 dz~ @ W_c^T through the reduce-add store."""
    dz, wct = example_operands(m, v, d, "k")
    G = torch.empty(m, d, dtype=torch.float32)
    return launch(passthrough, dz, wct, config=config, d=G, add_to_output=True, dry=True)
