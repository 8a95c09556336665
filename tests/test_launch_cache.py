"""coda's launch-plan cache (``coda._quack.run_epi_gemm``): the first call of a metadata class
plans through quack's frontend, later calls with the same dtypes, shapes and strides replay
the plan (any data), a change of any of them plans again, ``replay=False`` always takes the
frontend, and compile-only calls (``launch=False``) store nothing. An op's ``PlanTape``
replays its recorded plans in launch order without building keys, and turns itself off where
the sequence diverges. quack itself is replaced by recorders here: what is tested is coda's
keying, on the CPU."""

import pytest
import torch
from conftest import OnDevice1

from coda import _quack
from coda.kernels.config import DEFAULT, GemmConfig


class FakeMod:
    def __init__(self):
        self.planned = []

    def gemm(self, A, B, D, C, *, epi_args, _launch, **kw):
        plan = ("plan", len(self.planned))
        self.planned.append((tuple(A.shape), _launch))
        return plan


@pytest.fixture
def replays(monkeypatch):
    calls = []

    class Host:
        @staticmethod
        def run_gemm_epi_plan(plan, A, B, D, C, epi_args):
            calls.append((plan, A.data_ptr()))

    modules = dict(_quack._modules())
    modules["host"] = Host
    monkeypatch.setattr(_quack, "_modules", lambda: modules)
    monkeypatch.setattr(_quack, "_PLANS", {})
    return calls


def _args(m=64, k=32, n=48, vec_len=48):
    a, b = torch.randn(m, k), torch.randn(k, n)
    return a, b, torch.empty(m, n), {"gamma": torch.randn(1, vec_len)}


def test_same_metadata_replays_new_metadata_plans(replays):
    mod = FakeMod()
    a, b, d, e = _args()
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT)
    assert mod.planned == [((64, 32), True)] and replays == []
    a2, b2, d2, e2 = _args()  # same metadata, other data
    plan = _quack.run_epi_gemm(mod, a2, b2, d2, None, e2, DEFAULT)
    assert plan == ("plan", 0) and replays == [(("plan", 0), a2.data_ptr())]
    _quack.run_epi_gemm(mod, *_args(m=65)[:3], None, _args(m=65)[3], DEFAULT)  # new shape
    _quack.run_epi_gemm(mod, a, b.t().contiguous().t(), d, None, e, DEFAULT)  # new strides
    _quack.run_epi_gemm(mod, a, b, d, None, e, GemmConfig(tile_n=128))  # new config
    _quack.run_epi_gemm(mod, a, b, d, None, {"gamma": e["gamma"].double()}, DEFAULT)
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT, add_to_output=True)
    assert len(mod.planned) == 6 and len(replays) == 1
    a3 = torch.randn(64, 32, dtype=torch.float64)  # another dtype of A alone
    _quack.run_epi_gemm(mod, a3, b, d, None, e, DEFAULT)
    b2 = torch.randn(32, 48)  # B alone new, same metadata: replayed
    _quack.run_epi_gemm(mod, a, b2, d, None, e, DEFAULT)
    _quack.run_epi_gemm(mod, a, b, d, None, {**e, "width": 8}, DEFAULT)  # a plain value
    _quack.run_epi_gemm(mod, a, b, d, None, {**e, "width": 8}, DEFAULT)  # the same value
    _quack.run_epi_gemm(mod, a, b, d, None, {**e, "width": 16}, DEFAULT)  # another
    assert len(mod.planned) == 9 and len(replays) == 3


def test_plans_per_key_are_bounded_newest_first(replays, monkeypatch):
    monkeypatch.setattr(_quack, "MAX_PLANS_PER_KEY", 2)
    mod = FakeMod()
    a, b, d, e = _args()
    variants = [b, b.t().contiguous().t(), b.double()]  # three metadata classes of one key
    for bi in variants:
        _quack.run_epi_gemm(mod, a, bi, d, None, e, DEFAULT)
    (plans,) = _quack._PLANS.values()
    assert [p for _, p in plans] == [("plan", 2), ("plan", 1)]
    _quack.run_epi_gemm(mod, a, variants[0], d, None, e, DEFAULT)  # dropped: planned again
    assert len(mod.planned) == 4 and replays == []


def test_frontend_only_and_compile_only_calls_store_nothing(replays):
    mod = FakeMod()
    a, b, d, e = _args()
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT, replay=False)
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT, launch=False)
    assert _quack._PLANS == {} and len(mod.planned) == 2 and mod.planned[1][1] is False
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT)
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT, replay=False)  # still the frontend
    assert len(mod.planned) == 4 and replays == []


def test_cache_is_bounded(replays, monkeypatch):
    monkeypatch.setattr(_quack, "MAX_PLANS", 3)
    mod = FakeMod()
    for m in range(1, 8):
        a, b, d, e = _args(m=m)
        _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT)
    assert len(_quack._PLANS) <= 3


def test_a_launch_runs_on_its_tensors_device(replays, fake_devices, monkeypatch):
    """A on device 1 while device 0 is current: the frontend's first launch and the replay
    after it each run with device 1 current (``coda._device``), device 0 current again
    after; a compile-only call switches nothing, nor does A on the current device."""
    seen = []

    class Mod(FakeMod):
        def gemm(self, *args, **kw):
            seen.append(("gemm", fake_devices["current"]))
            return super().gemm(*args, **kw)

    class Host:
        @staticmethod
        def run_gemm_epi_plan(plan, *args):
            seen.append(("replay", fake_devices["current"]))

    modules = {**_quack._modules(), "host": Host}
    monkeypatch.setattr(_quack, "_modules", lambda: modules)
    mod = Mod()
    a, b, d, e = _args()
    a = a.as_subclass(OnDevice1)
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT)
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT)
    assert seen == [("gemm", 1), ("replay", 1)] and fake_devices["entered"] == [1, 1]
    assert fake_devices["current"] == 0
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT, launch=False)
    fake_devices["current"] = 1
    _quack.run_epi_gemm(mod, a, b, d, None, e, DEFAULT)
    assert seen[2:] == [("gemm", 0), ("replay", 1)] and fake_devices["entered"] == [1, 1]


# -- an op's plan tape (``_quack.PlanTape``): plans taken in launch order, no key built ---------
def _no_keys(monkeypatch):
    class Refuse(dict):
        def get(self, *args):
            raise AssertionError("a taped replay looked a plan up by key")

    monkeypatch.setattr(_quack, "_PLANS", Refuse())


def test_a_tape_records_one_call_and_replays_it_without_keys(replays, monkeypatch):
    mod1, mod2 = FakeMod(), FakeMod()
    tape = _quack.PlanTape()
    with tape:  # the op's first call: keyed lookups, every plan kept in order
        _quack.run_epi_gemm(mod1, *_args()[:3], None, _args()[3], DEFAULT)
        _quack.run_epi_gemm(mod2, *_args()[:3], None, _args()[3], GemmConfig(tile_n=128))
    assert tape.state == "replay" and [p for _, _, p in tape.plans] == [("plan", 0)] * 2
    _no_keys(monkeypatch)
    for _ in range(2):  # later calls: the same plans, in the same order
        a, b, d, e = _args()
        with tape:
            assert _quack.run_epi_gemm(mod1, a, b, d, None, e, DEFAULT) == ("plan", 0)
            _quack.run_epi_gemm(mod2, a, b, d, None, e, GemmConfig(tile_n=128))
    assert len(replays) == 4 and replays[-2][1] == a.data_ptr()
    assert len(mod1.planned) == len(mod2.planned) == 1


def test_a_tape_that_diverges_turns_off_and_the_key_serves(replays):
    mod1, mod2 = FakeMod(), FakeMod()
    tape = _quack.PlanTape()
    with tape:
        _quack.run_epi_gemm(mod1, *_args()[:3], None, _args()[3], DEFAULT)
    with tape:  # another program where the tape holds mod1's plan
        plan = _quack.run_epi_gemm(mod2, *_args()[:3], None, _args()[3], DEFAULT)
    assert plan == ("plan", 0) and len(mod2.planned) == 1  # planned for mod2, not mod1's
    assert tape.state == "off" and tape.plans == []
    with tape:  # off for good: every launch keyed
        _quack.run_epi_gemm(mod2, *_args()[:3], None, _args()[3], DEFAULT)
    assert tape.state == "off" and len(mod2.planned) == 1 and len(replays) == 1
    other = _quack.PlanTape()  # a config other than the recorded one diverges too
    with other:
        _quack.run_epi_gemm(mod1, *_args()[:3], None, _args()[3], DEFAULT)
    with other:
        _quack.run_epi_gemm(mod1, *_args()[:3], None, _args()[3], GemmConfig(tile_n=128))
    assert other.state == "off" and len(mod1.planned) == 2


def test_a_call_that_raises_records_nothing_and_tapes_nest(replays):
    mod = FakeMod()
    tape, inner = _quack.PlanTape(), _quack.PlanTape()
    with pytest.raises(RuntimeError):
        with tape:
            _quack.run_epi_gemm(mod, *_args()[:3], None, _args()[3], DEFAULT)
            raise RuntimeError("the op failed after its first launch")
    assert tape.state == "record" and tape.plans == [] and _quack._ACTIVE.tape is None
    with tape:
        with inner:  # an op inside an op: the inner call's launches are the inner tape's
            _quack.run_epi_gemm(mod, *_args()[:3], None, _args()[3], DEFAULT)
        assert _quack._ACTIVE.tape is tape
        _quack.run_epi_gemm(mod, *_args(m=65)[:3], None, _args(m=65)[3], DEFAULT)
    assert len(inner.plans) == 1 and [p for _, _, p in tape.plans] == [("plan", 1)]


def test_frontend_only_launches_stay_off_the_tape(replays):
    mod = FakeMod()
    tape = _quack.PlanTape()
    with tape:
        _quack.run_epi_gemm(mod, *_args()[:3], None, _args()[3], DEFAULT, replay=False)
    assert tape.plans == [] and tape.state == "replay"
    with tape:
        _quack.run_epi_gemm(mod, *_args()[:3], None, _args()[3], DEFAULT, replay=False)
    assert len(mod.planned) == 2 and tape.state == "replay"


def test_a_tape_serves_only_the_thread_that_made_it(replays):
    """Another thread entering the same tape launches keyed and leaves it as it was."""
    import threading

    mod = FakeMod()
    tape = _quack.PlanTape()
    with tape:
        _quack.run_epi_gemm(mod, *_args()[:3], None, _args()[3], DEFAULT)
    seen = []

    def other():
        with tape:
            seen.append(_quack._ACTIVE.tape)
            _quack.run_epi_gemm(mod, *_args(m=65)[:3], None, _args(m=65)[3], DEFAULT)

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen == [None] and len(mod.planned) == 2  # keyed: a new plan for m = 65
    assert tape.state == "replay" and [p for _, _, p in tape.plans] == [("plan", 0)]
    with tape:  # still the owner's, intact
        assert _quack.run_epi_gemm(mod, *_args()[:3], None, _args()[3], DEFAULT) == ("plan", 0)


def test_a_compile_count_needs_quack_s_compile_step():
    """``_quack.count_compiles`` (the sm_90a compile tests' count, on a GPU-less machine)
    accepts only the driver's refusal after quack's compile step: a call that never reaches it
    raises, and any other error propagates."""
    with pytest.raises(RuntimeError, match="compile step was not reached"):
        _quack.count_compiles(lambda: None)

    def refused():
        raise ValueError("tile_N must divide N")

    with pytest.raises(ValueError, match="tile_N"):
        _quack.count_compiles(refused)

    def driverless():  # (the driver's error, but before any compile lookup)
        raise RuntimeError("cuda driver not found")

    with pytest.raises(RuntimeError, match="cuda driver"):
        _quack.count_compiles(driverless)
