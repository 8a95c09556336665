"""A loss's target range rule (``coda.kernels.target_check``): each target in [0, vocab) or
``ignore_index``. On the CPU a bad one is named (``CodaInputError``); on a GPU one Triton launch
stops at a device-side assertion that the next synchronizing call raises. CI runs the kernel
in Triton's interpreter (which compiles no assertions: valid targets pass) and checks that its
sm_90 code holds the assertion; the H200 runs the failure, in a child process (a device-side
assertion ends the CUDA context)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import triton_child
from conftest import sm90_available

import coda
import coda.nn as cnn
from coda.kernels import target_check as tc

V = 50


@pytest.mark.parametrize("bad", [V, V + 7, -1, -101])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_bad_target_is_named_on_the_cpu(bad, dtype):
    x, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(8, V, dtype=torch.float64)
    t = torch.tensor([0, V - 1, -100, 3, bad, 4], dtype=dtype)
    rule = rf"target: values must be in \[0, {V}\) or ignore_index \(-100\); got {bad}"
    with pytest.raises(coda.CodaInputError, match=rule):
        coda.linear_cross_entropy(x, w, t)
    head = cnn.LMHeadLoss(8, V, dtype=torch.float64)
    with pytest.raises(coda.CodaInputError, match=rule):
        head(x.view(2, 3, 8), t.view(2, 3))
    t[4] = -100  # ignored rows and both ends of the range pass
    assert torch.isfinite(coda.linear_cross_entropy(x, w, t))
    assert torch.isfinite(head(x.view(2, 3, 8), t.view(2, 3)))


_CHILD = """
import json, torch
from coda.kernels import target_check as tc
runs = 0
for n in (1, 7, 4096, 4097, 10000):
    for dtype in (torch.int64, torch.int32):
        t = torch.randint(0, 1000, (n,), dtype=dtype)
        t[:: 3] = -100
        tc.launch_target_rule(t, 1000, -100)
        runs += 1
print(json.dumps(runs))
"""


def test_the_kernel_runs_in_tritons_interpreter():
    assert triton_child.results(_CHILD) == 10


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["*i64", "*i32"])
def test_the_kernel_compiles_for_sm90_with_its_assertion(dtype):
    from coda.kernels._triton import cubin_sm90

    assert "__assertfail" in tc.target_rule_ptx(dtype)
    # (compiled without debug, Triton drops the assertion: the flag is what keeps it)
    plain = cubin_sm90(tc._target_rule_kernel, {"t_ptr": dtype}, {"BLOCK": tc.BLOCK}, part="ptx")
    assert "__assertfail" not in plain


_GPU_CHILD = """
import torch, coda, coda.nn as cnn
torch.manual_seed(0)
d, V = 256, 1024
x = torch.randn(2, 300, d, device="cuda", dtype=torch.bfloat16)
t = torch.randint(0, V, (2, 300), device="cuda")
t[1, 7] = {bad}
if {op}:
    with torch.no_grad():
        coda.linear_cross_entropy(x.view(-1, d), torch.randn(d, V, device="cuda",
                                  dtype=torch.bfloat16), t.view(-1))
else:
    cnn.LMHeadLoss(d, V, device="cuda")(x, t).backward()
torch.cuda.synchronize()
print("finished")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not sm90_available(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("op, bad", [(False, 1024), (True, -5)])
def test_gpu_a_bad_target_stops_the_call(op, bad):
    """A target past the vocabulary (``LMHeadLoss``, forward and backward) or negative and
    not ignore_index (``coda.linear_cross_entropy``) fails the call at its next
    synchronization with the rule's message (ignored rows pass in every other gpu test)."""
    code = _GPU_CHILD.format(bad=bad, op=op)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "finished" not in out, out[-2000:]
    assert "target out of range" in out, out[-2000:]
