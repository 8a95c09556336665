"""The LM head's exact target entries in dW (``add_target_terms``) as two Triton kernels (GPU).

CE-C and CE-S leave each row's target entry out of their bf16 GEMM operands and add its share
in fp32 (why: ``linear_cross_entropy_chunked.add_target_terms``, whose torch form stays the
CPU path and the oracle); dW's share here,

    dW^T[y_m]  += h_m a_m                a scatter-add of one row per token into V x d

(dL/da's share, h_m W[:, y_m], the final norm's backward adds: ``final_norm_rows``). In
torch the scatter-add is ``index_put_(accumulate=True)``, which sorts and then reduces each
index's rows in a kernel that took 1.8 ms of the 12.9 ms LM-head step at d=2048, V=32768 on
the H200 (run 19). Here each row's int32 sort key (its target, or V out of range:
``sort_keys``, one launch) is sorted once (a stable sort: ties keep token order) and two
kernels add the rows, with no atomics, so deterministically:

- ``_chunk_sums_kernel``: each program takes CH consecutive sorted rows and sums each run of
  equal targets inside them in fp32, in token order. A run that starts and ends inside the
  chunk is added to its row of dst there. A run that crosses the chunk's first or last row
  leaves its piece in a scratch slot instead: the chunk's HEAD slot (the piece continues a run
  from the chunk before) or its TAIL slot (a run that starts here and goes on).
- ``_run_sums_kernel``: the chunk where such a run starts adds its TAIL piece and the HEAD
  pieces of the chunks the run covers next, QB at a time, to the run's row of dst.

No program walks more than CH rows or a long run's pieces: with one program per run (this
kernel until session 29) the most frequent token of Zipf-distributed ids (2251 of 16384) made
one program walk 2251 rows in sequence, 1.25 ms of a 0.29 ms backward (run 127). Rows whose
target is out of range (ignored, padding: their h is 0) sort last under the key V and are
skipped. The same kernels without the per-row factor are the token embedding's backward,
dE[t_m] += dx_m (``coda.kernels.embedding``): ``scatter_rows_triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coda.kernels._launch import acc_dtype
from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel

CH, BD = 16, 512  # sorted rows per program, columns per program
QB = 16  # a long run's pieces summed per step of ``_run_sums_kernel``
# a chunk's two scratch slots, part[chunk, slot, :]: 0 its HEAD piece, 1 its TAIL piece


@triton.jit
def _chunk(keys, M, d, CH: tl.constexpr, BD: tl.constexpr):
    """This program's chunk: its index p, its sorted rows [i0, stop), its columns and their
    mask, and the keys either side of it (-1 past either end)."""
    p = tl.program_id(0)
    i0 = p * CH
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    stop = tl.minimum(i0 + CH, M)
    before = tl.load(keys + i0 - 1, mask=i0 > 0, other=-1)
    after = tl.load(keys + stop, mask=stop < M, other=-1)
    return p, i0, stop, cols, cols < d, before, after


def _chunk_sums_kernel(
    dw, a, keys, order, coef, part, M, V, d, dw_row, a_row,
    CH: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    p, i0, stop, cols, cm, before, after = _chunk(keys, M, d, CH, BD)
    j = i0
    while tl.load(keys + j, mask=j < stop, other=V) < V:  # each run (piece) in the chunk
        key = tl.load(keys + j)
        head = (j == i0) & (key == before)
        acc = tl.zeros([BD], dtype=ACC)
        while tl.load(keys + j, mask=j < stop, other=-1) == key:
            r = tl.load(order + j).to(tl.int64)
            x = tl.load(a + r * a_row + cols, mask=cm, other=0.0).to(ACC)
            if SCALED:
                x = tl.load(coef + r).to(ACC) * x
            acc += x
            j += 1
        tail = (j == stop) & (key == after)
        if head | tail:  # a piece of a run that crosses the chunk's edge: its slot
            slot = tl.where(head, 0, 1)
            tl.store(part + (p * 2 + slot).to(tl.int64) * d + cols, acc, mask=cm)
        else:
            at = dw + key.to(tl.int64) * dw_row + cols
            total = tl.load(at, mask=cm, other=0.0).to(ACC) + acc
            tl.store(at, total.to(dw.dtype.element_ty, fp_downcast_rounding="rtne"), mask=cm)


def _run_sums_kernel(
    dw, keys, part, M, V, d, dw_row,
    CH: tl.constexpr, BD: tl.constexpr, QB: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    p, i0, stop, cols, cm, before, after = _chunk(keys, M, d, CH, BD)
    last = tl.load(keys + stop - 1)
    if (last == after) & (last < V) & (last != before):  # a run starts here and goes on
        acc = tl.load(part + (p * 2 + 1).to(tl.int64) * d + cols, mask=cm, other=0.0)
        q = p + 1
        full = True
        while full:  # the HEAD pieces of the next chunks while they start inside the run
            qs = q + tl.arange(0, QB)
            hit = tl.load(keys + qs * CH, mask=qs * CH < M, other=-1) == last
            slots = (qs * 2).to(tl.int64)[:, None] * d + cols[None, :]
            x = tl.load(part + slots, mask=hit[:, None] & cm[None, :], other=0.0)
            acc += tl.sum(x.to(ACC), axis=0)
            full = tl.sum(hit.to(tl.int32), axis=0) == QB
            q += QB
        at = dw + last.to(tl.int64) * dw_row + cols
        total = tl.load(at, mask=cm, other=0.0).to(ACC) + acc
        tl.store(at, total.to(dw.dtype.element_ty, fp_downcast_rounding="rtne"), mask=cm)


def sort_keys_torch(index, V: int):
    """Each row's sort key: its index where it lies in [0, V), else V (sorted last, skipped);
    int32, whose radix sort makes half the passes an int64 sort makes (V < 2^31). The torch
    form: the oracle, and the path for a strided ``index`` (five launches on the GPU)."""
    return torch.where((index >= 0) & (index < V), index, V).to(torch.int32)


def _sort_keys_kernel(index, keys, M, V, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < M
    i = tl.load(index + offs, mask=live, other=0)
    tl.store(keys + offs, tl.where((i >= 0) & (i < V), i, V).to(tl.int32), mask=live)


KEYS_BLOCK = 4096  # rows a program: 32 a thread at 4 warps


def sort_keys(index, V: int):
    """``sort_keys_torch`` as one Triton launch where ``index`` is contiguous."""
    if not index.is_contiguous():
        return sort_keys_torch(index, V)
    M = index.numel()
    keys = torch.empty(M, dtype=torch.int32, device=index.device)
    if M:
        grid = (cdiv(M, KEYS_BLOCK),)
        kernel(_sort_keys_kernel)[grid](index, keys, M, V, BLOCK=KEYS_BLOCK, num_warps=4)
    return keys


def scatter_rows_triton(dst, src, index, coef=None):
    """dst[index_m] += coef_m src_m for every row m whose index lies in [0, V) (``coef``
    None: 1), summed in fp32 (float64 in proofs) per destination row, in token order within
    each chunk of CH sorted rows and then chunk by chunk, and added to it once. dst (V, d) and
    src (M, d) with unit column strides. The LM head's ``add_target_terms`` on the GPU (dst its
    fp32 dW accumulator), and the embedding's backward (``coda.kernels.embedding``, coef None)."""
    M, d = src.shape
    V = dst.shape[0]
    assert src.stride(1) == 1 and dst.stride(1) == 1, (src.stride(), dst.stride())
    if M == 0:
        return
    keys, order = torch.sort(sort_keys(index, V), stable=True)
    grid = (cdiv(M, CH), cdiv(d, BD))
    # the pieces' scratch, read only where written
    part = dst.new_empty(grid[0], 2, d, dtype=acc_dtype(dst))
    kernel(_chunk_sums_kernel)[grid](
        # (unscaled: the kernel never reads its coef pointer; any tensor stands in)
        dst, src, keys, order, keys if coef is None else coef, part, M, V, d, dst.stride(0),
        src.stride(0), CH=CH, BD=BD, ACC=acc_type(dst), SCALED=coef is not None,
    )  # fmt: skip
    if M > CH:  # with one chunk no run crosses a chunk's edge
        kernel(_run_sums_kernel)[grid](
            dst, keys, part, M, V, d, dst.stride(0), CH=CH, BD=BD, QB=QB, ACC=acc_type(dst)
        )


def compile_scatter(arch: int = 90, scaled: bool = True) -> list[int]:
    """The three kernels compiled for ``sm_{arch}`` on the CPU, as the LM head runs them
    (``scaled``: fp32 dW, a factor per row) or as the embedding's backward does (bf16 dE, no
    factor), from bf16 rows, int64 indices and int32 sorted keys: their cubins' sizes."""
    pointers = {"coef": "*fp32", "dw": "*fp32", "a": "*bf16", "keys": "*i32", "order": "*i64"}
    pointers["part"] = "*fp32"
    if not scaled:
        pointers.update(dw="*bf16", coef="*i32")
    consts = {"CH": CH, "BD": BD, "ACC": tl.float32}
    return [
        compile_sm90(
            _sort_keys_kernel, {"index": "*i64", "keys": "*i32"}, {"BLOCK": KEYS_BLOCK}, arch=arch
        ),
        compile_sm90(_chunk_sums_kernel, pointers, {**consts, "SCALED": scaled}, arch=arch),
        compile_sm90(_run_sums_kernel, pointers, {**consts, "QB": QB}, arch=arch),
    ]


def compile_target_terms(arch: int = 90) -> list[int]:
    """The LM head's scatter compiled for ``sm_{arch}`` on the CPU: its cubins' sizes."""
    return compile_scatter(arch, scaled=True)
