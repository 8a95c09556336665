"""coda's launch-plan cache (``coda._quack.run_epi_gemm``): the first call of a metadata class
plans through quack's frontend, later calls with the same dtypes, shapes and strides replay
the plan (any data), a change of any of them plans again, ``replay=False`` always takes the
frontend, and compile-only calls (``launch=False``) store nothing. quack itself is replaced
by recorders here: what is tested is coda's keying, on the CPU."""

import pytest
import torch

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
