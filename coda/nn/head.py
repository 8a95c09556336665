"""The final RMSNorm + LM head + cross-entropy: ``LMHeadLoss`` (owns its weights) and
``lm_head_loss`` (given them, as ``coda.transformers`` calls it), through
``coda.autograd.LinearCrossEntropyFunction`` on the kernel path (logits never stored) and
the pure-torch reference elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from coda import _validate as v
from coda.autograd import (
    LM_HEAD_METHODS,
    LinearCrossEntropyFunction,
    resolve_lm_head_method,
)
from coda.env import (
    BACKENDS,
    autocast_off,
    compute_dtype,
    resolve_backend,
)
from coda.kernels.target_check import checked_targets
from coda.nn._common import FormerNames, in_dtype, tma_rule
from coda.reference.cross_entropy import cross_entropy_ref
from coda.reference.rmsnorm import final_norm_ref, ref_dtype


class LMHeadLoss(FormerNames, nn.Module):
    """Final RMSNorm + LM head + cross-entropy. ``weight`` is (vocab, d), as ``nn.Linear``'s
    and HF's ``lm_head.weight``; ``w_lm`` is its (d, vocab) view, logits = y @ w_lm. Stored so,
    the kernel path's fp32 (vocab, d) weight-gradient accumulator leaves as the gradient without
    a transpose, and the exact target terms read each target's weights as one contiguous row
    (2.5 % of the step at d = 4096, vocab = 128256 on the H200: benchmarks/NOTES.md, session 15).

    ``method`` picks the kernel path's cross-entropy program: "auto" (the default: "scaled_exp"
    when vocab % 128 == 0, else "recompute"), "scaled_exp" (CE-S: three GEMMs, the forward
    stores the softmax numerators and the dX and dW GEMMs read them back; the fastest coda
    method on the H200 at every measured shape, benchmarks/NOTES.md; an fp32 vocab x d
    gradient buffer and ~1 GiB of numerators per token chunk), "recompute" (CE-A: the logits
    are recomputed in the backward, 4 GEMMs, least memory) or "chunked" (CE-C: 3 GEMMs, the
    logits stored per token chunk). With reduction "none" every method runs the recompute
    program. The three-GEMM programs form their gradients in fp32 at an upstream gradient
    g = 1 and apply g in the backward before the one rounding to bf16, so any g (a mean loss,
    gradient accumulation, loss scaling) gives PyTorch's rounding.
    ``label_smoothing`` is ``F.cross_entropy``'s; ``z_loss`` adds z * logsumexp(logits)^2 per
    non-ignored token (PaLM's auxiliary loss), reduced with the loss. ``softcap`` c (Gemma 2's
    ``final_logit_softcapping``): the loss of the soft-capped logits c tanh(l / c), on CE-S's
    capped program ("scaled_exp", "auto"'s: the fastest on the H200, run 293) or the
    "recompute" program (least memory); not with label smoothing, nor "chunked".

    Parameters: ``final_norm`` (the final RMSNorm's gain, (d,); ``gf`` before session 21,
    still loaded under that name) and ``weight``."""

    RENAMED = {"gf": "final_norm"}

    def __init__(
        self,
        d: int,
        vocab: int,
        eps: float = 1e-5,
        ignore_index: int = -100,
        chunk: int = 16384,
        method: str = "auto",
        device=None,
        dtype=torch.bfloat16,
        backend: str = "auto",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
    ):
        super().__init__()
        self.label_smoothing, self.z_loss = v.check_ce_options(label_smoothing, z_loss)
        self.softcap = v.check_softcap(softcap, self.label_smoothing, method)
        v.check_positive_int("d", d)
        v.check_positive_int("vocab", vocab)
        v.check_positive_int("chunk", chunk)
        v.check_eps(eps)
        v.check_param_dtype(dtype)
        v.check_choice("method", method, LM_HEAD_METHODS)
        v.check_choice("backend", backend, BACKENDS)
        ignore_index = v.check_ignore_index(ignore_index)
        self.d, self.vocab = d, vocab
        self.eps, self.ignore_index, self.chunk, self.backend = eps, ignore_index, chunk, backend
        self.method = method
        self.final_norm = nn.Parameter(torch.ones(d, device=device, dtype=dtype))
        self.weight = nn.Parameter(torch.empty(vocab, d, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        """The constructor's initialization: weight ~ N(0, std), the final norm's gain 1."""
        nn.init.normal_(self.weight, std=std)
        nn.init.ones_(self.final_norm)

    @property
    def w_lm(self) -> torch.Tensor:
        """The LM head as the (d, vocab) matrix of logits = y @ w_lm: a view of ``weight``."""
        return self.weight.t()

    def __setattr__(self, name, value):
        # nn.Module registers an assigned Parameter under its name before any property
        # setter runs: ``head.w_lm = p`` would add a parameter the loss never reads
        if name == "w_lm":
            raise AttributeError(
                "LMHeadLoss.w_lm is the (d, vocab) view of weight (vocab, d): assign weight"
            )
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor, target: torch.Tensor, reduction: str = "mean"):
        """x (batch, seq, d) or (tokens, d), target (batch, seq) or (tokens,) int64/int32 in
        [0, vocab) or ``ignore_index`` -> the loss (fp32). reduction: "mean" (NaN when every
        target is ignored, as in PyTorch), "sum" or "none" (per-token losses)."""
        return lm_head_loss(
            x,
            self.final_norm,
            self.w_lm,
            target,
            eps=self.eps,
            ignore_index=self.ignore_index,
            reduction=reduction,
            method=self.method,
            chunk=self.chunk,
            backend=self.backend,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits this loss is taken of, for evaluation and sampling (the loss never
        forms them): x (batch, seq, d) or (tokens, d) -> (..., vocab) in x's dtype, the final
        norm and the LM head as HF's causal LMs compute them (``final_norm_ref``, then one
        torch GEMM on any device), capped by ``softcap`` as Gemma 2's forward caps them."""
        v.check_activation("LMHeadLoss.logits", x, self.d, self.weight, ndim=(2, 3))
        logits = final_norm_ref(x, self.final_norm, self.eps) @ self.w_lm
        if self.softcap is None:
            return logits
        wide = logits.to(ref_dtype(logits))  # (the cap formed as the loss forms it)
        return (self.softcap * torch.tanh(wide / self.softcap)).to(logits.dtype)

    def _kernel_loss(self, xf, t, reduction):
        """The kernel sequence on (tokens, d) rows (on CPU tensors: through the interpreter)."""
        return _kernel_lm_head_loss(
            xf,
            self.final_norm,
            self.w_lm,
            t,
            self.eps,
            self.ignore_index,
            reduction,
            self.chunk,
            self.method,
            self.label_smoothing,
            self.z_loss,
            self.softcap,
        )

    def hf_state_dict(self) -> dict:
        return {
            "model.norm.weight": self.final_norm.detach().clone(),
            "lm_head.weight": self.weight.detach().clone(),
        }

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict) -> None:
        """Load HF ``model.norm.weight`` and ``lm_head.weight``; a missing key or a wrong shape
        raises ``CodaInputError`` naming the key."""
        shapes = {"model.norm.weight": (self.d,), "lm_head.weight": (self.vocab, self.d)}
        v.check_state_dict(sd, shapes)
        self.final_norm.copy_(sd["model.norm.weight"])
        self.weight.copy_(sd["lm_head.weight"])


def _kernel_lm_head_loss(
    xf, gamma, w_lm, t, eps, ignore_index, reduction, chunk, method,
    label_smoothing=0.0, z_loss=0.0, softcap=None,
):  # fmt: skip
    """The LM head's kernel sequence on validated (tokens, d) rows (``coda.autograd``); the
    program is chosen once here, knowing whether a gradient will be taken
    (``resolve_lm_head_method``)."""
    needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in (xf, gamma, w_lm))
    method = resolve_lm_head_method(method, w_lm.shape[1], needs_grad)
    args = (eps, ignore_index, reduction, chunk, method, label_smoothing, z_loss, softcap)
    # bf16 inside torch.autocast, as DecoderLayer's kernel path; w_lm is cast inside the
    # Function, which returns its gradient in w_lm's own dtype (fp32 unrounded, for CE-C/CE-S);
    # an fp32 gain stays fp32: the norm's kernels widen the gain to fp32 on load either way,
    # and its gradient returns unrounded (``final_norm_ref``'s rounding)
    dtype = compute_dtype(xf)
    (xf,) = in_dtype(dtype, xf)
    if gamma.dtype != torch.float32:
        (gamma,) = in_dtype(dtype, gamma)
    with autocast_off(xf.device):
        return LinearCrossEntropyFunction.apply(xf.contiguous(), gamma, w_lm, t, *args)


def lm_head_loss(
    x,
    gamma,
    w_lm,
    target,
    *,
    eps: float = 1e-5,
    ignore_index: int = -100,
    reduction: str = "mean",
    method: str = "auto",
    chunk: int = 16384,
    backend: str = "auto",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
):
    """Final RMSNorm (``gamma``) + LM head (``w_lm`` (d, vocab), either major: an HF
    ``lm_head.weight.t()`` view is fine) + cross-entropy, with parameters given: what
    ``LMHeadLoss`` computes, for models that own their weights (``coda.transformers``).
    ``gamma`` in x's dtype, or in fp32, kept so on both paths (applied in fp32 before the
    normed rows' one rounding, its gradient fp32: Gemma's final norm forms its gain 1 + w in
    fp32, ``coda.reference.final_norm_ref``)."""
    v.check_tensor("w_lm", w_lm)
    if w_lm.dim() != 2:
        raise v.CodaInputError(f"w_lm: expected a 2-D (d, vocab) tensor, got {tuple(w_lm.shape)}")
    d, vocab = w_lm.shape
    v.check_activation("lm_head_loss", x, d, w_lm, ndim=(2, 3))
    v.check_vector("gamma", gamma, ("d", d))
    if gamma.dtype not in (x.dtype, compute_dtype(x), torch.float32):
        raise v.CodaInputError(
            f"gamma: dtype must be x's ({x.dtype}) or torch.float32 (a gain kept in fp32, as "
            f"Gemma's final norm forms 1 + w), got {gamma.dtype}"
        )
    v.check_tensor("target", target)
    v.check_same_device({"x": x, "w_lm": w_lm, "gamma": gamma, "target": target})
    v.check_choice("reduction", reduction, v.REDUCTIONS)
    v.check_choice("method", method, LM_HEAD_METHODS)
    v.check_eps(eps)
    label_smoothing, z_loss = v.check_ce_options(label_smoothing, z_loss)
    softcap = v.check_softcap(softcap, label_smoothing, method)
    ignore_index = v.check_ignore_index(ignore_index)
    t = checked_targets(target, x.shape[:-1], vocab, ignore_index)
    xf = x.reshape(-1, d)
    path = resolve_backend("LMHeadLoss", backend, x.device, compute_dtype(x), empty=x.numel() == 0)
    if path == "kernel":
        rule = tma_rule(d=d, vocab=vocab)
        if rule and vocab % 8:  # the usual case: a token added to a vocabulary
            rule += (
                "; an HF model can pad its embedding and head: "
                "model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=128)"
            )
        if not rule and method == "scaled_exp" and vocab % 128:
            rule = f"method 'scaled_exp' needs vocab % 128 == 0 (its strips), got {vocab}"
        if rule:
            raise v.CodaInputError(f"LMHeadLoss (kernel path): {rule}")
        opts = (label_smoothing, z_loss, softcap)
        loss = _kernel_lm_head_loss(
            xf, gamma, w_lm, t, eps, ignore_index, reduction, chunk, method, *opts
        )
    else:
        logits = final_norm_ref(xf, gamma, eps) @ w_lm  # as HF: in x's dtype, the loss in fp32+
        loss = cross_entropy_ref(
            logits, t, ignore_index, reduction, label_smoothing, z_loss, softcap
        )
    return loss.view(target.shape) if reduction == "none" else loss
