"""The device call's test runner (``benchmarks/gpu_tests.py``): which failures it takes for
the card's memory (a junit report's failure or error naming torch's or the driver's
out-of-memory error), how it names them for pytest, and the rerun that gives each of them the
GPU to itself. No GPU: the rerun here runs a CPU test."""

from __future__ import annotations

from benchmarks import gpu_tests

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_xielu" name="test_gpu_xielu_layer_and_head_every_gradient">
  <failure message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB"/>
</testcase>
<testcase classname="tests.test_demos" name="test_gpu_hf_finetune_curves_match">
  <failure message="AssertionError: Traceback">
    torch.AcceleratorError: CUDA error: out of memory</failure>
</testcase>
<testcase classname="tests.test_fuzz" name="test_gpu_fuzz[seed-3]">
  <error message="RuntimeError: CUDA error: out of memory"/>
</testcase>
<testcase classname="tests.test_graphs" name="test_gpu_replay_is_bitwise">
  <failure message="AssertionError: replay differs">assert False</failure>
</testcase>
<testcase classname="tests.test_graphs" name="test_gpu_passing"/>
</testsuite></testsuites>
"""


def test_out_of_memory_failures_are_named_as_pytest_node_ids(tmp_path):
    xml = tmp_path / "report.xml"
    xml.write_text(JUNIT)
    assert gpu_tests._out_of_memory(str(xml)) == [
        "tests/test_xielu.py::test_gpu_xielu_layer_and_head_every_gradient",
        "tests/test_demos.py::test_gpu_hf_finetune_curves_match",
        "tests/test_fuzz.py::test_gpu_fuzz[seed-3]",
    ]  # (an assertion's failure is the test's: not rerun)


def test_node_ids_follow_the_module_file_and_a_class():
    assert gpu_tests._node_id("tests.test_fuzz", "t[a]") == "tests/test_fuzz.py::t[a]"
    assert gpu_tests._node_id("tests.test_fuzz.TestC", "t") == "tests/test_fuzz.py::TestC::t"
    assert gpu_tests._node_id("tests.no_such_module", "t") is None


def test_the_rerun_runs_each_test_alone_and_reports_its_outcome(tmp_path):
    ran = "tests/test_bench_selections.py::test_selected_names_are_checked"
    missing = "tests/test_bench_selections.py::test_no_such_test"
    out = gpu_tests.rerun_alone([ran], str(tmp_path), None, budget_s=120)
    assert out["outcomes"] == {ran: "passed"} and not out["timed_out"]
    assert "$OUT" in out["command"] and str(tmp_path) not in out["command"]
    assert (
        gpu_tests.rerun_alone([ran, missing], str(tmp_path), None, 120)["outcomes"][missing]
        == "not run"
    )
    # nothing to rerun, or under a minute of the call's budget left: no rerun at all
    assert gpu_tests.rerun_alone([], str(tmp_path), None, 120) == {}
    assert gpu_tests.rerun_alone([ran], str(tmp_path), None, budget_s=59) == {}
