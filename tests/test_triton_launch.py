"""coda's Triton launcher (``coda.kernels._triton.Kernel``): the first launch of each
specialization key goes through Triton's own call and keeps the compiled kernel it returns;
later launches with that key go to it directly, with the arguments in the kernel's parameter
order; anything that can change what Triton compiles (a tensor's dtype, device or 16-byte
alignment, any other argument's value, a launch option) is a new key. Triton itself is
replaced by recorders in the CPU tests (what they test is coda's keying); the gpu test at the
end launches every coda Triton kernel both ways on the H200 and compares the bits."""

import pytest
import torch
from conftest import OnDevice1

from coda.kernels import _triton


def _fn(x, y, n, eps, BM, ACC):  # the parameters of a kernel, in order
    pass


class FakeCompiled:
    def __init__(self, log, tag):
        self.log, self.tag = log, tag

    def __getitem__(self, grid):
        assert len(grid) == 3, grid  # as Triton's CompiledKernel indexes it
        return lambda *args, **kw: self.log.append(("direct", self.tag, grid, args, kw))


class FakeJit:
    def __init__(self, log):
        self.log, self.compiles = log, 0

    def __getitem__(self, grid):
        def run(*args, **named):
            self.compiles += 1
            self.log.append(("jit", grid, args, tuple(sorted(named.items()))))
            return FakeCompiled(self.log, self.compiles)

        return run


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(_triton, "interpreted", lambda: False)
    monkeypatch.setattr(_triton, "_current_stream", lambda: 77)  # a stream handle
    k = _triton.Kernel(_fn)
    log = []
    k.jit = FakeJit(log)
    return k, log


def _call(k, x, y, n=64, eps=1e-5, grid=(4,), **named):
    named = {"BM": 16, "ACC": "fp32", "num_warps": 4, **named}
    k[grid](x, y, n, eps, **named)


def test_the_second_launch_of_a_key_goes_to_the_compiled_kernel(launcher):
    k, log = launcher
    x, y = torch.zeros(64), torch.zeros(64)
    _call(k, x, y)
    _call(k, x, y, grid=(8,))
    assert [e[0] for e in log] == ["jit", "direct"]
    kind, tag, grid, args, kw = log[1]
    assert tag == 1 and grid == (8, 1, 1)
    assert args == (x, y, 64, 1e-5, 16, "fp32")  # positional, then the constexprs in order
    assert kw == {"stream": 77}  # the current stream, read at the launch


def test_without_a_stream_reader_triton_reads_the_stream(launcher, monkeypatch):
    k, log = launcher
    monkeypatch.setattr(_triton, "_current_stream", None)  # a torch build without CUDA
    x, y = torch.zeros(64), torch.zeros(64)
    _call(k, x, y)
    _call(k, x, y)
    assert log[1][0] == "direct" and log[1][4] == {}


def test_any_specialization_change_goes_through_triton(launcher):
    k, log = launcher
    x, y = torch.zeros(64), torch.zeros(64)
    _call(k, x, y)
    _call(k, x, y, n=65)  # an integer's value
    _call(k, x, y, eps=1e-6)  # a float's
    _call(k, x.double(), y)  # a dtype
    _call(k, x[1:], y)  # 4 bytes off: no longer 16-byte aligned
    _call(k, x, y, BM=32)  # a constexpr
    _call(k, x, y, num_warps=8)  # a launch option
    assert [e[0] for e in log] == ["jit"] * 7
    for n, eps, xx, bm, w in ((65, 1e-5, x, 16, 4), (64, 1e-6, x, 16, 4), (64, 1e-5, x, 16, 8)):
        _call(k, xx, y, n=n, eps=eps, BM=bm, num_warps=w)
    assert [e[0] for e in log[7:]] == ["direct"] * 3
    assert [e[1] for e in log[7:]] == [2, 3, 7]  # each its own compiled kernel


def test_true_is_not_one(launcher):
    k, log = launcher
    x, y = torch.zeros(64), torch.zeros(64)
    _call(k, x, y, BM=1)
    _call(k, x, y, BM=True)
    _call(k, x, y, n=1)  # positional: keyed by type first, then value
    _call(k, x, y, n=True)
    _call(k, x, y, n=1.0)
    assert [e[0] for e in log] == ["jit"] * 5


def test_a_tensor_subclass_is_keyed_as_a_tensor(launcher):
    """A ``Parameter`` (any tensor subclass) keys by dtype, device and alignment, as a tensor:
    a second parameter with those launches the kept kernel."""
    k, log = launcher
    y = torch.zeros(64)
    _call(k, torch.nn.Parameter(torch.zeros(64)), y)
    _call(k, torch.nn.Parameter(torch.ones(64)), y)
    assert [e[0] for e in log] == ["jit", "direct"]


def test_switched_off_and_unhashable_arguments_go_through_triton(launcher, monkeypatch):
    k, log = launcher
    x, y = torch.zeros(64), torch.zeros(64)
    _call(k, x, y, ACC=[1])  # unhashable
    _call(k, x, y, ACC=[1])
    monkeypatch.setattr(_triton, "FAST_LAUNCH", False)
    _call(k, x, y)
    _call(k, x, y)
    assert [e[0] for e in log] == ["jit"] * 4


def test_a_missing_parameter_is_never_cached(launcher):
    k, log = launcher
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        k[(1,)](x, y, 64, 1e-5, BM=16, num_warps=4)  # ACC left to Triton (which would refuse)
    assert [e[0] for e in log] == ["jit", "jit"]


def test_the_cache_is_bounded(launcher, monkeypatch):
    k, log = launcher
    monkeypatch.setattr(_triton, "MAX_COMPILED", 2)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in (16, 32, 48):
        _call(k, x, y, n=n)
    assert len(k.compiled) == 1  # emptied when full, then the newest kept


class DeviceLog(list):
    """A launch log that also notes the (fake) current device at each launch."""

    def __init__(self, state):
        super().__init__()
        self.state, self.devices = state, []

    def append(self, entry):
        self.devices.append(self.state["current"])
        super().append(entry)


def test_a_launch_runs_on_its_tensors_device(launcher, fake_devices):
    """Tensors on device 1 while device 0 is current: Triton's own first launch and the
    direct one after it each run with device 1 current, and device 0 is current again after;
    tensors on the current device launch without a switch."""
    k, _ = launcher
    log = k.jit.log = DeviceLog(fake_devices)
    x, y = (torch.zeros(64).as_subclass(OnDevice1) for _ in range(2))
    _call(k, x, y)
    _call(k, x, y)
    assert [e[0] for e in log] == ["jit", "direct"]
    assert log.devices == [1, 1] and fake_devices["entered"] == [1, 1]
    assert fake_devices["current"] == 0
    fake_devices["current"] = 1  # the tensors' device current: no switch
    _call(k, x, y)
    assert log.devices[-1] == 1 and fake_devices["entered"] == [1, 1]
    fake_devices["current"] = 0  # CPU tensors (Triton's interpreter): no device to switch to
    _call(k, torch.zeros(64), torch.zeros(64))
    _call(k, torch.zeros(64), torch.zeros(64))
    assert log.devices[-2:] == [0, 0] and fake_devices["entered"] == [1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_direct_launches_equal_tritons_own(monkeypatch):
    """Every coda Triton kernel on the H200, launched by Triton's own call and then (its key
    seen once) directly: the same bits, at an odd token count and with a 2-byte-misaligned
    input (a key of its own, compiled without the alignment assumption)."""
    from coda.kernels.final_norm_rows import head_norm_bwd_triton
    from coda.kernels.norm_rows import CORR, RSTD, norm_rows_triton, row_stat_triton
    from coda.kernels.row_passes import drope_heads_triton
    from coda.kernels.target_terms import scatter_rows_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    bf, f32 = torch.bfloat16, torch.float32

    def r(*s, dt=bf):
        return torch.randn(*s, generator=g, device="cuda", dtype=dt)

    M, d, V, B, S, H, Hkv, hd = 1001, 512, 4096, 1, 1001, 4, 2, 64
    flat = r(M * d + 1)
    x, x_off = flat[:-1].view(M, d), flat[1:].view(M, d)  # the second 2 bytes off
    gamma, rstd = r(d), torch.rand(M, generator=g, device="cuda") + 0.5
    parts = r(M, 7, dt=f32).abs()
    heads = r(B, S, H + 2 * Hkv, hd).transpose(1, 2)
    dq, dk, dv = heads[:, :H], heads[:, H : H + Hkv], heads[:, H + Hkv :]
    qkv = r(M, (H + 2 * Hkv) * hd)
    theta = r(M, hd // 2, dt=f32)
    a, w = r(M, d), r(V, d).t()
    target = torch.randint(0, V, (M,), generator=g, device="cuda")
    target[::7] = -100
    coef = r(M, dt=f32) * (target >= 0)
    G0, D0, S0, up = r(M, d, dt=f32), r(V, d, dt=f32), r(M, dt=f32), r((), dt=f32)

    def every_kernel():
        D = D0.clone()
        scatter_rows_triton(D, a, target, coef)
        return [
            *norm_rows_triton(x, gamma, 1e-5, True),
            *norm_rows_triton(x_off, gamma, 1e-5, False),
            row_stat_triton(parts, None, d, 1e-5, RSTD),
            row_stat_triton(parts, rstd, d, 1e-5, CORR),
            *drope_heads_triton(dq, dk, dv, qkv, rstd, theta.cos(), theta.sin(), H + Hkv, hd, d),
            D,
            *head_norm_bwd_triton(G0, coef, S0, target, w, x, gamma, rstd, up),
        ]

    monkeypatch.setattr(_triton, "FAST_LAUNCH", False)
    own = every_kernel()
    monkeypatch.setattr(_triton, "FAST_LAUNCH", True)
    every_kernel()  # keys seen (Triton's call)
    hits = []
    real_launch = _triton.Kernel.launch

    def counting(self, grid, args, named):
        hits.append(self.key(args, named) in self.compiled)
        return real_launch(self, grid, args, named)

    monkeypatch.setattr(_triton.Kernel, "launch", counting)
    direct = every_kernel()
    assert hits and all(hits), hits  # every launch went to its compiled kernel
    for i, (o, t) in enumerate(zip(own, direct)):
        assert o.dtype == t.dtype and torch.equal(o, t), i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_direct_launches_follow_the_current_stream():
    """A direct launch goes to the stream current at the call: captured into a CUDA graph
    (the capture runs on a side stream; a launch on any other stream fails the capture or is
    missing from the replay), replayed on new data, equal to an eager launch."""
    from coda.kernels.norm_rows import norm_rows_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(257, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    gamma = torch.randn(512, generator=g, device="cuda", dtype=torch.bfloat16)
    norm_rows_triton(x, gamma, 1e-5, False)  # the key seen: the captured launch is direct
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, rstd = norm_rows_triton(x, gamma, 1e-5, False)
    x.copy_(torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    want_out, want_rstd = norm_rows_triton(x, gamma, 1e-5, False)
    assert torch.equal(out, want_out) and torch.equal(rstd, want_rstd)
