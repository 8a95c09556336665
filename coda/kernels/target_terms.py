"""The LM head's exact target entries (``add_target_terms``) as two Triton kernels (GPU).

CE-C and CE-S leave each row's target entry out of their bf16 GEMM operands and add its share
in fp32 (why: ``linear_cross_entropy_chunked.add_target_terms``, whose torch form stays the
CPU path and the oracle):

    G[m]       += h_m W[:, y_m]          a gather of one column of W per row
    dW^T[y_m]  += h_m a_m                a scatter-add of one row per token into V x d

In torch the scatter-add is ``index_put_(accumulate=True)``, which sorts and then reduces each
index's rows in a kernel that took 1.8 ms of the 12.9 ms LM-head step at d=2048, V=32768 on the
H200 (run 19), and the gather three launches. Here:

- ``_gather_kernel``: one pass over G, adding h_m W[:, y_m] for a (rows x d) tile of rows
  taken in target-sorted order: in coda's (d, V) layout a column of W is d reads strided by V,
  one 32-byte sector each for one useful element, and rows whose targets are close share those
  sectors (a token chunk over a 32k vocabulary has a target every ~2 columns once sorted);
- ``_scatter_kernel``: the rows sorted by target once (a stable sort: ties keep token order),
  each program takes CH consecutive sorted rows and owns every run of equal targets that
  *starts* among them, summing the run's rows in order (past its CH rows if the run goes on)
  and adding the sum to dW^T's row once. No atomics, so the result is deterministic; each
  (vocabulary row, column block) is written by one program. Rows whose target is out of
  range (ignored, padding: their h is 0) sort last under the key V and are skipped.
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel

ROWS, COLS = 32, 256  # the gather's tile
CH, BD = 16, 512  # the scatter: sorted rows per program, columns per program


def _gather_kernel(
    G, W, keys, order, coef, M, V, d, g_row, w_d, w_v,
    BM: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0) * BM + tl.arange(0, BM)  # positions in the target-sorted order
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    live = j < M
    mask = live[:, None] & (cols < d)[None, :]
    rows = tl.load(order + j, mask=live, other=0).to(tl.int64)
    t = tl.minimum(tl.load(keys + j, mask=live, other=0), V - 1).to(tl.int64)
    h = tl.load(coef + rows, mask=live, other=0.0).to(ACC)
    w = tl.load(W + cols.to(tl.int64)[None, :] * w_d + t[:, None] * w_v, mask=mask, other=0.0)
    at = rows[:, None] * g_row + cols[None, :]
    g = tl.load(G + at, mask=mask, other=0.0)
    tl.store(G + at, g + h[:, None] * w.to(ACC), mask=mask)


def _scatter_kernel(
    dw, a, keys, order, coef, M, V, d, dw_row, a_row,
    CH: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
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
            acc += tl.load(coef + r).to(ACC) * x
            j += 1
        at = dw + key.to(tl.int64) * dw_row + cols
        tl.store(at, tl.load(at, mask=cm, other=0.0) + acc, mask=cm)


def add_target_terms_triton(G, dw_t, a, target, coef, w_lm):
    """``add_target_terms`` (same arguments) in two kernels. G (M, d) and dw_t (V, d) fp32
    (float64 in proofs) with unit column stride, either None (the gather kernel not launched
    without G, the scatter kernel not without dw_t: a frozen weight); w_lm (d, V) in either
    layout."""
    M, d = a.shape
    V = w_lm.shape[1]
    assert a.stride(1) == 1 and all(t is None or t.stride(1) == 1 for t in (G, dw_t))
    if M == 0 or (G is None and dw_t is None):
        return
    # int32 keys: the radix sort makes half the passes it makes over int64 (V < 2^31)
    keys = torch.where((target >= 0) & (target < V), target, V).to(torch.int32)
    keys, order = torch.sort(keys, stable=True)
    if G is not None:
        grid = (cdiv(M, ROWS), cdiv(d, COLS))
        kernel(_gather_kernel)[grid](
            G, w_lm, keys, order, coef, M, V, d, G.stride(0), w_lm.stride(0), w_lm.stride(1),
            BM=ROWS, BD=COLS, ACC=acc_type(G),
        )  # fmt: skip
    if dw_t is not None:
        grid = (cdiv(M, CH), cdiv(d, BD))
        kernel(_scatter_kernel)[grid](
            dw_t, a, keys, order, coef, M, V, d, dw_t.stride(0), a.stride(0),
            CH=CH, BD=BD, ACC=acc_type(dw_t),
        )  # fmt: skip


def compile_target_terms(arch: int = 90) -> list[int]:
    """Both kernels (fp32 G / dW, bf16 W and a, int32 sorted targets) compiled for ``sm_{arch}`` on
    the CPU: cubin sizes."""
    pointers = {"G": "*fp32", "W": "*bf16", "coef": "*fp32", "dw": "*fp32"}
    pointers.update({"a": "*bf16", "keys": "*i32", "order": "*i64"})
    return [
        compile_sm90(_gather_kernel, pointers, {"BM": ROWS, "BD": COLS, "ACC": tl.float32}),
        compile_sm90(_scatter_kernel, pointers, {"CH": CH, "BD": BD, "ACC": tl.float32}),
    ]
