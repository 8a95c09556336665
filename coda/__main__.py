"""``python -m coda``: the stack coda runs on (torch, quack-kernels, cutlass-dsl and whether
they are the pinned versions, the GPU, its SM, whether the kernel path can run there)."""

from coda.env import describe

for key, value in describe().items():
    print(f"{key:12s} {value}")
