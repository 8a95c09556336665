"""The LM head's exact target entries in dW (``add_target_terms``) as a Triton kernel (GPU).

CE-C and CE-S leave each row's target entry out of their bf16 GEMM operands and add its share
in fp32 (why: ``linear_cross_entropy_chunked.add_target_terms``, whose torch form stays the
CPU path and the oracle); dW's share here,

    dW^T[y_m]  += h_m a_m                a scatter-add of one row per token into V x d

(dL/da's share, h_m W[:, y_m], the final norm's backward adds: ``final_norm_rows``). In
torch the scatter-add is ``index_put_(accumulate=True)``, which sorts and then reduces each
index's rows in a kernel that took 1.8 ms of the 12.9 ms LM-head step at d=2048, V=32768 on
the H200 (run 19). Here ``_scatter_kernel`` takes the rows sorted by target once (a stable
sort: ties keep token order); each program takes CH consecutive sorted rows and owns every
run of equal targets that *starts* among them, summing the run's rows in order (past its CH
rows if the run goes on) and adding the sum to dW^T's row once. No atomics, so the result is
deterministic; each (vocabulary row, column block) is written by one program. Rows whose
target is out of range (ignored, padding: their h is 0) sort last under the key V and are
skipped. The same kernel without the per-row factor is the token embedding's backward,
dE[t_m] += dx_m (``coda.kernels.embedding``): ``scatter_rows_triton``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel

CH, BD = 16, 512  # sorted rows per program, columns per program


def _scatter_kernel(
    dw, a, keys, order, coef, M, V, d, dw_row, a_row,
    CH: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    i0 = tl.program_id(0) * CH
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < d
    stop = tl.minimum(i0 + CH, M)
    j = i0
    if i0 > 0:  # a run that began in an earlier program is that program's
        prev = tl.load(keys + i0 - 1)
        while tl.load(keys + j, mask=j < stop, other=-1) == prev:
            j += 1
    while tl.load(keys + j, mask=j < stop, other=V) < V:  # each run starting here
        key = tl.load(keys + j)
        acc = tl.zeros([BD], dtype=ACC)
        while tl.load(keys + j, mask=j < M, other=-1) == key:
            r = tl.load(order + j).to(tl.int64)
            x = tl.load(a + r * a_row + cols, mask=cm, other=0.0).to(ACC)
            if SCALED:
                x = tl.load(coef + r).to(ACC) * x
            acc += x
            j += 1
        at = dw + key.to(tl.int64) * dw_row + cols
        total = tl.load(at, mask=cm, other=0.0).to(ACC) + acc
        tl.store(at, total.to(dw.dtype.element_ty, fp_downcast_rounding="rtne"), mask=cm)


def scatter_rows_triton(dst, src, index, coef=None):
    """dst[index_m] += coef_m src_m for every row m whose index lies in [0, V) (``coef``
    None: 1), summed in fp32 (float64 in proofs) per destination row in token order and added
    to it once. dst (V, d) and src (M, d) with unit column strides. The LM head's
    ``add_target_terms`` on the GPU (dst its fp32 dW accumulator), and the embedding's
    backward (``coda.kernels.embedding``, coef None)."""
    M, d = src.shape
    V = dst.shape[0]
    assert src.stride(1) == 1 and dst.stride(1) == 1, (src.stride(), dst.stride())
    if M == 0:
        return
    # int32 keys: the radix sort makes half the passes it makes over int64 (V < 2^31)
    keys = torch.where((index >= 0) & (index < V), index, V).to(torch.int32)
    keys, order = torch.sort(keys, stable=True)
    kernel(_scatter_kernel)[(cdiv(M, CH), cdiv(d, BD))](
        # (unscaled: the kernel never reads its coef pointer; any tensor stands in)
        dst, src, keys, order, keys if coef is None else coef, M, V, d, dst.stride(0),
        src.stride(0), CH=CH, BD=BD, ACC=acc_type(dst), SCALED=coef is not None,
    )  # fmt: skip


def compile_target_terms(arch: int = 90) -> list[int]:
    """The kernel compiled for ``sm_{arch}`` on the CPU, as the LM head runs it (fp32 dW, bf16
    a, int32 sorted targets, a factor per row) and as the embedding's backward does (bf16 dE,
    no factor): its cubins' sizes."""
    pointers = {"coef": "*fp32", "dw": "*fp32", "a": "*bf16", "keys": "*i32", "order": "*i64"}
    consts = {"CH": CH, "BD": BD, "ACC": tl.float32}
    plain = {**pointers, "dw": "*bf16", "coef": "*i32"}
    return [
        compile_sm90(_scatter_kernel, pointers, {**consts, "SCALED": True}, arch=arch),
        compile_sm90(_scatter_kernel, plain, {**consts, "SCALED": False}, arch=arch),
    ]
