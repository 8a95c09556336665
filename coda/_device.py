"""On which CUDA device a kernel launches: its tensors', whatever the current device is.

Triton's launcher and CuTe DSL's both launch on the *current* CUDA device and its current
stream, while torch's own ops follow their tensors. A process that drives several GPUs
without ``torch.cuda.set_device`` (an HF model placed with ``device_map="auto"``, one
layer on ``cuda:1`` while ``cuda:0`` is current) would otherwise launch coda's kernels on
the wrong device, with another device's pointers: an illegal memory access, or a kernel
on another stream than the torch ops around it. So coda's two launch sites
(``kernels._triton.Kernel.launch`` and ``_quack.run_epi_gemm``) make their tensors'
device current for the launch (``torch.cuda.device``) where it is not: the state of a
process that called ``set_device`` for that device, which every measured setup runs
(one GPU; torchrun's ranks). Where the device is already current, which is every call in
such a setup, the check is one C call and an integer compare.
"""

from __future__ import annotations

import torch

# the current CUDA device's index in one C call (torch.cuda.current_device() adds a lazy-init
# check); None in a torch build without CUDA, whose tensors never ask
_current = getattr(torch._C, "_cuda_getDevice", None)


def foreign(index: int) -> bool:
    """Whether a launch on device ``index`` (``Tensor.get_device()``: -1 for a CPU tensor)
    must first make it current: a CUDA device other than the current one."""
    return index >= 0 and index != _current()
