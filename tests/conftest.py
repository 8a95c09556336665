"""Test setup. Without a GPU, kernels are compiled for sm_90a (CUTE_DSL_ARCH / QUACK_ARCH) with
quack's on-disk cache off, so every compile test really compiles. ``gpu`` tests skip cleanly
without an SM90 GPU."""

import contextlib
import math
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("QUACK_ARCH", "90")
    os.environ.setdefault("QUACK_CACHE_ENABLED", "0")
    # Triton's own default since its 3.x line (the H200 image's 3.6 fuses mul+add into fma),
    # said explicitly: newer Triton warns that its default will change
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from coda.env import CodaReferencePathWarning  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist's workers share the cores: each takes its share of intra-op threads (with
    # torch's default, a thread per core in every worker, ``-n 2`` on two cores ran the
    # suite in 648 s against 698 s in one process; with one thread each, 392 s: session 68)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def sm90_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# the longest `gpu` tests (H200, session 6: 391, 281, 94 and 89 s), started first so that
# side-by-side workers (``gpu_suite.py --workers``) finish together instead of waiting on them
LONGEST_FIRST = (
    "test_gpu_fuzz_decoder_layer_protocol",
    "test_gpu_fuzz_lm_head_loss_protocol",
    "test_gpu_hf_finetune_curves_match",
    "test_gpu_fuzz_op_protocol",
)


# the same for the CPU suite (``-n 2``): its longest tests, 14-53 s each (session 78, a cold
# Triton and Inductor cache), started first instead of where collection puts them, so that
# neither worker ends the run alone on one of them
CPU_LONGEST_FIRST = (
    "test_row_passes_in_triton_interpreter_equal_oracles",
    "test_qk_norm_rope_compiles_for_sm90",  # (two of ~21 s: session 87)
    "test_the_patch_adds_no_graph_break_to_a_moe_model",
    "test_rope_loads_integer_positions_for_sm90",
    "test_inductor_never_takes_its_implicit_fallback_for_a_coda_op",
    "test_post_norm_kernels_in_triton_interpreter_equal_torch_forms",
    "test_qk_norm_whole_passes_in_triton_interpreter_equal_torch_forms",
    "test_fsdp2_two_gloo_ranks_match_one_process",
    "test_fsdp2_over_compiled_coda_layers_matches_one_process",
    "test_kernel_path_runs_the_triton_kernels_in_the_interpreter",
    "test_fsdp2_a_model_made_on_meta_and_loaded_matches_one_process",
    "test_compiled_step_equals_eager_and_does_not_recompile",
    "test_fsdp2_shards_a_patched_hf_model",
    "test_train_demo_compile_flag_runs_the_same_steps",
)


def pytest_collection_modifyitems(config, items):
    first = LONGEST_FIRST if sm90_available() else CPU_LONGEST_FIRST
    rank = {name: i for i, name in enumerate(first)}
    items.sort(key=lambda item: rank.get(item.originalname, len(rank)))  # stable
    if sm90_available():
        return
    skip = pytest.mark.skip(reason="needs an SM90 CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_reference_path():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CodaReferencePathWarning)
        yield


@contextlib.contextmanager
def no_cache_warnings_from_dynamo():
    """Fails if torch.compile met a ``functools.lru_cache`` wrapper inside the block: Dynamo
    warns at every such call site (a user compiling a coda model would see one warning per
    site); coda's host caches (``coda.env.host_cache``) step aside while it traces."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    sites = [str(w.message)[:120] for w in caught if "lru_cache" in str(w.message)]
    assert not sites, sites


@pytest.fixture(params=["reference", "kernel"])
def coda_path(request, monkeypatch):
    """Run a float64 parity test on coda's reference path (the CPU default), and again with
    the kernel path forced (``kernel_support`` answers yes: the patched layers and the loss
    run the kernel sequence, GEMMs through the tile interpreter). Returns the config overrides
    the kernel path needs (a vocabulary of 16-byte rows)."""
    import coda.env

    if request.param == "reference":
        yield {}
        return
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    coda.env._LAST.clear()
    yield {"vocab_size": 128}
    assert coda.last_path("DecoderLayer")[0] == coda.last_path("LMHeadLoss")[0] == "kernel"


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |got - ref| / max(max |ref|, floor) (the float64 verifier's metric).

    ``floor`` is an absolute scale of the problem (e.g. the largest of a set of gradients): a
    quantity that is identically zero for some shapes (a q/k gradient when every sequence has
    one token) has only round-off left, and comparing round-off to round-off relatively is
    ill-posed. Without a floor, ``ref`` must not be identically zero."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    if got.numel() == 0:
        return 0.0
    scale = max(float(ref.abs().max()), floor)
    if scale == 0.0:
        raise AssertionError("rel_err: the reference is identically zero; pass a floor")
    return float((got - ref).abs().max()) / scale


def fro_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref||_F / ||ref||_F (CODA's error protocol)."""
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-300))


def assert_no_worse(name: str, got, ref, peer) -> None:
    """CODA's protocol for one output: finite, and its error vs ``ref`` (fp32 or float64) no
    worse than ``peer``'s (the plain PyTorch bf16 path's)."""
    e_k, e_t = fro_err(got, ref), fro_err(peer, ref)
    assert torch.isfinite(got).all(), name
    assert e_k <= e_t, f"{name}: coda {e_k:.3e} vs torch bf16 {e_t:.3e}"


def random_dims(seed: int, **ranges) -> dict:
    """One random instantiation of named dimensions, each drawn from [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    return {k: int(torch.randint(lo, hi + 1, (1,), generator=g)) for k, (lo, hi) in ranges.items()}


def tie_band(ref, dof: int | None = None, z: float = 2.0) -> float:
    """How far above 1.0 a ratio of two relative Frobenius errors can land by chance when both
    paths make errors of the same size: two standard deviations of that ratio.

    Each error is an estimate from independent roundings. A rounding error scales with the
    value rounded, so the squared Frobenius error is a weighted sum dominated by the largest
    entries: its effective number of samples is n_eff = (sum r^2)^2 / sum r^4 over the
    reference ``ref`` (= numel when every entry has the same size, far fewer when a few
    columns dominate, as the target columns of an LM head's dW do). Each error then has a
    relative spread of ~1/sqrt(2 n_eff) and their ratio ~1/sqrt(n_eff). A ratio inside the band
    is a tie (neither path is measurably more accurate); a systematic excess, such as 1.03 on
    a million elements, is outside it. ``ref`` may be an element count (n_eff = numel).
    Scalars (n_eff 1) have their own floor in the callers.

    ``dof`` caps n_eff where the errors are correlated by construction: a weight gradient
    dW = sum_t a_t g_t^T over T tokens carries the errors of T pairs of vectors, so at most
    T (rows + cols) independent ones however many entries it has; attention's q/k gradients
    come through the score gradient dS (B H S (S + 1) / 2 entries under a causal mask), which
    on a short sequence is a small difference of nearly equal terms whose few roundings
    dominate (tests/test_fuzz_gpu.py, NOTES.md)."""
    return band_of(effective_samples(ref, dof), z)


def effective_samples(ref, dof: int | None = None) -> float:
    """``tie_band``'s n_eff of ``ref`` (a tensor, or an element count), capped at ``dof``."""
    if isinstance(ref, torch.Tensor):
        r2 = ref.detach().double().nan_to_num(0.0).pow(2)  # an all-NaN mean: band 0
        n_eff = float(r2.sum() ** 2 / r2.pow(2).sum().clamp(min=1e-300))
    else:
        n_eff = float(ref)
    return n_eff if dof is None else min(n_eff, float(dof))


def weight_grad_samples(x: torch.Tensor, g: torch.Tensor) -> float:
    """n_eff of the roundings a weight gradient dW = g^T x over T tokens carries (x: (T, in),
    the layer input; g: (T, out), the output gradient): the entries of x and g, each rounding
    error as large as the value rounded and reaching dW multiplied by the other operand's row
    at that token. The weighted form of ``tie_band``'s T (rows + cols) count: two tokens of a
    heavy-tailed activation (a SwiGLU output) carry far fewer effective roundings than entries."""
    x, g = x.detach().double().flatten(0, -2), g.detach().double().flatten(0, -2)
    via_x = g.norm(dim=1, keepdim=True) * x
    via_g = x.norm(dim=1, keepdim=True) * g
    return effective_samples(torch.cat([via_x.flatten(), via_g.flatten()]))


class LinearOperands(torch.overrides.TorchFunctionMode):
    """Records, for each weight passed to ``F.linear`` inside the mode, the layer input and
    (once backward has run) the output gradient: the two operands of its weight gradient.
    ``samples(w)`` is their ``weight_grad_samples``."""

    def __init__(self):
        super().__init__()
        self.seen = []  # [weight, input, output gradient]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear:
            rec = [args[1], args[0].detach(), None]
            self.seen.append(rec)
            if out.requires_grad:
                out.register_hook(lambda grad, rec=rec: rec.__setitem__(2, grad.detach()))
        return out

    def samples(self, grad: torch.Tensor) -> float | None:
        """``weight_grad_samples`` of the weight whose ``.grad`` is ``grad`` (None if unseen)."""
        for w, x, g in self.seen:
            if w.grad is grad and g is not None:
                return weight_grad_samples(x, g)
        return None


def band_of(n_eff: float, z: float = 2.0) -> float:
    """z standard deviations of the ratio of two errors of n_eff samples each: each error is
    ~ sqrt(chi^2_n / n), so the log of their ratio has a spread of ~1/sqrt(n)."""
    return 0.0 if n_eff <= 1 else math.expm1(z / n_eff**0.5)


def pooled_ratio(errors: list[tuple[float, float]], z: float = 2.0) -> tuple[float, float]:
    """(ratio, band) of one gradient's error pooled over independent runs (seeds): ``errors``
    holds each run's (coda's error, PyTorch's), the ratio is that of their RMS, sqrt(sum c^2 /
    sum t^2), and the band z standard errors of it estimated from the runs themselves (the
    delta method on log(mean c^2) - log(mean t^2), which counts the two paths' correlation
    within a run). Where one run's ratio is chance (the q and k gradients of a model whose
    softmax the biases saturate: 0.6-2.1 from seed to seed), the pooled one shrinks toward
    the paths' true ratio as 1/sqrt(runs), and a ratio above 1 + band is a measurable excess."""
    n = len(errors)
    a = [c * c for c, _ in errors]
    b = [t * t for _, t in errors]
    ma, mb = sum(a) / n, sum(b) / n
    u = [x / ma - y / mb for x, y in zip(a, b)]
    var_log = sum(v * v for v in u) / (n - 1) / n if n > 1 else math.inf
    return (ma / mb) ** 0.5, math.expm1(z * 0.5 * var_log**0.5)


def seed_errors(got: torch.Tensor, ref: torch.Tensor, peer: torch.Tensor) -> tuple[float, float]:
    """One seed's (coda's error, PyTorch's) for ``pooled_ratio`` (arguments in
    ``assert_no_worse``'s order): the absolute Frobenius errors ||got - ref|| and
    ||peer - ref||. Their pooled RMS ratio is the ratio of the two paths'
    relative Frobenius errors of the gradient stacked over the seeds: the protocol's tensor
    metric itself, each seed's entries weighted alike, as a tensor's entries are. Each seed's
    own relative error (``fro_err``) would weight seed s by 1 / ||ref_s||^2: harmless for a
    tensor, whose norm barely moves from seed to seed, but a one-element gradient (xIELU's
    learned scalars) changes sign from seed to seed, and the few seeds whose reference lands
    near 0 then decide the pooled ratio alone, beyond what the band estimated from the runs
    can see: two tied paths fail it 15-21 % of the time (``test_protocol``; session 79)."""
    got, peer, ref = (t.detach().double() for t in (got, peer, ref))
    return float((got - ref).norm()), float((peer - ref).norm())


def family_z(checks: int, alpha: float = 0.05) -> float:
    """The band's z for a family of ``checks`` comparisons (a fuzz test's cases x outputs):
    one-sided, Bonferroni, so that a path that merely ties fails the whole family with
    probability <= ``alpha`` (z = 2 per check would fail ~2 % of checks by chance: dozens in
    a 200-case fuzz of 13 outputs). Never below 2."""
    from statistics import NormalDist

    return max(2.0, NormalDist().inv_cdf(1.0 - alpha / max(1, checks)))


@pytest.fixture(autouse=True)
def _fresh_op_checks():
    """Each test starts with no memoized op checks (``coda.ops._checked``): a test that
    monkeypatches a check or the backend choice must see its patch run, not an earlier
    test's verdict for the same input signature."""
    from coda import ops

    ops._CHECKED.clear()
    yield


class OnDevice1(torch.Tensor):
    """A CPU tensor that reports CUDA device 1 (``get_device``): what the launch sites read
    to pick a launch's device (``coda._device``), for the CPU tests of that choice."""

    def get_device(self) -> int:
        return 1


@pytest.fixture
def fake_devices(monkeypatch):
    """A stand-in for the current CUDA device: ``coda._device`` reads ``state["current"]``,
    and ``torch.cuda.device(i)`` makes ``i`` current within its block (``state["entered"]``
    lists each ``i``)."""
    import coda._device

    state = {"current": 0, "entered": []}
    monkeypatch.setattr(coda._device, "_current", lambda: state["current"])

    @contextlib.contextmanager
    def device(index):
        before, state["current"] = state["current"], index
        state["entered"].append(index)
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch.cuda, "device", device)
    return state


def assert_compiled_graphs_train_as_eager(eager, batches, loss_of) -> None:
    """``torch.compile(mode="reduce-overhead")`` over a copy of the CUDA model ``eager``: one
    AdamW step per batch, replays among them, gives the eager model's losses and gradients
    (the glue's bf16 rounding aside), and no CUDA graph is skipped. ``loss_of(run, batch)`` is
    a step's loss from a model or its compiled form."""
    import copy

    from torch._dynamo.utils import counters

    graphed = copy.deepcopy(eager)
    compiled = torch.compile(graphed, mode="reduce-overhead")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (eager, graphed)]
    counters["inductor"]["cudagraph_skips"] = 0
    for step, batch in enumerate(batches):
        results = []
        for run, model, opt in zip((eager, compiled), (eager, graphed), opts):
            torch.compiler.cudagraph_mark_step_begin()
            loss = loss_of(run, batch)
            loss.backward()
            grads = [p.grad.float().clone() for p in model.parameters()]
            results.append([loss.detach().float().clone(), *grads])  # graph-owned buffers
            opt.step()
            opt.zero_grad(set_to_none=True)
        for a, e in zip(*results):
            assert ((a - e).norm() / e.norm()).item() < 2e-2, step
    assert counters["inductor"]["cudagraph_skips"] == 0
