"""``XIELU``: the numbers of xIELU, Apertus's MLP activation (arXiv:2411.13010), as a module
laid out as Hugging Face's ``XIELUActivation`` (parameters ``alpha_p``, ``alpha_n`` of shape
(1,), buffers ``beta``, ``eps``), so that a ``DecoderLayer(activation="xielu")`` holding it
as ``mlp.act_fn`` has HF's state-dict keys for them. The activation itself runs in the
layer's F4 and B4 epilogues (``coda.kernels.gemm_swiglu``), which read its numbers from
device memory (``numbers``): the learned two never pass through the host."""

from __future__ import annotations

import math

import torch
from torch import nn

from coda.reference.swiglu import xielu_act


def _softplus_inverse(y: float) -> float:
    return math.log(math.expm1(y))


class XIELU(nn.Module):
    """xIELU's a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n), learned, and its
    constants beta and eps (HF's defaults: a_p = a_n = 0.8 at initialization, beta 0.5,
    eps -1e-6), in ``dtype`` (HF's: the model's)."""

    def __init__(
        self, alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6, device=None, dtype=None
    ):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self._init = (float(alpha_p_init), float(alpha_n_init) - float(beta))
        self.alpha_p = nn.Parameter(torch.empty(1, **kw))
        self.alpha_n = nn.Parameter(torch.empty(1, **kw))
        self.register_buffer("beta", torch.tensor(float(beta), **kw))
        self.register_buffer("eps", torch.tensor(float(eps), **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        self.alpha_p.fill_(_softplus_inverse(self._init[0]))
        self.alpha_n.fill_(_softplus_inverse(self._init[1]))

    @classmethod
    def adopt(cls, hf_act) -> XIELU:
        """A copy of HF's ``XIELUActivation`` ``hf_act`` (its values and dtypes, its
        parameters' ``requires_grad``)."""
        out = cls(device=hf_act.alpha_p.device, dtype=hf_act.alpha_p.dtype)
        out.load_state_dict(hf_act.state_dict())  # (HF's keys are these four)
        out.alpha_p.requires_grad_(hf_act.alpha_p.requires_grad)
        out.alpha_n.requires_grad_(hf_act.alpha_n.requires_grad)
        return out

    def numbers(self) -> torch.Tensor:
        """(a_p, a_n, beta, eps) as one (4,) fp32 tensor (float64 for float64 parameters),
        differentiable in alpha_p and alpha_n (``reference.swiglu.xielu_act``)."""
        return xielu_act(self.alpha_p, self.alpha_n, self.beta, self.eps)

    def extra_repr(self) -> str:
        return "xIELU (alpha_p, alpha_n learned; beta, eps constant)"
