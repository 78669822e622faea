"""The benchmark runner on the CPU: tiny shapes, the row schema, ratios and files."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest
import torch

from gemmconv import Direction, Layout
from gemmconv.bench import (
    SUITE,
    Shape,
    main,
    make_operands,
    make_problem,
    rewrite_fn,
    suite_cases,
)
from gemmconv.bench_report import default_stem
from gemmconv.solvers.vendor import VendorSolver
from gemmconv.verify import reference, rms_range

REQUIRED = {
    "case", "layout", "direction", "dtype", "solver", "vendor_ms", "linear_ms",
    "gemmconv_ms", "floor_ms", "rms_error", "immediate_solver", "immediate_gap",
    "extra_bytes", "largest_operand_bytes", "flop_floor_ms", "byte_floor_ms",
}  # fmt: skip


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--device", "cpu", "--quick", "--cases", "point2d,vit_b16,resnet_1x1",
            "--warmup", "0", "--reps", "2", "--out", str(out), "--name", "cpu"]  # fmt: skip
    code = main(argv)
    return code, out


def test_quick_cpu_run_writes_every_row_verified(quick_run):
    code, out = quick_run
    assert code == 0
    data = json.loads((out / "cpu.json").read_text())
    assert data["device"] == "cpu" and data["torch"] == torch.__version__
    rows = data["rows"]
    # point2d in three dtypes, the other two in bf16; 2 layouts x 3 directions each.
    assert len(rows) == (3 + 1 + 1) * 2 * 3
    assert {(r["case"], r["dtype"]) for r in rows} == {
        ("point2d", "bf16"), ("point2d", "fp16"), ("point2d", "fp32"),
        ("vit_b16", "bf16"), ("resnet_1x1", "bf16"),
    }  # fmt: skip
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["verified"] and r["candidates"][r["solver"]]["ok"]
        assert all(c["ok"] for c in r["candidates"].values()), r["candidates"]
        assert r["rms_error"] <= 2**-7


def test_ratios_and_floor_follow_from_the_times(quick_run):
    _, out = quick_run
    data = json.loads((out / "cpu.json").read_text())
    rates = data["rates"]
    for r in data["rows"]:
        assert r["floor_ms"] == max(r["flop_floor_ms"], r["byte_floor_ms"])
        tflops = rates["matrix_tflops"][r["dtype"]]
        assert r["flop_floor_ms"] == pytest.approx(r["flops"] / (tflops * 1e9))
        assert r["byte_floor_ms"] == pytest.approx(r["min_bytes"] / (rates["bandwidth_gbs"] * 1e6))
        assert r["speedup_vs_vendor"] == pytest.approx(r["vendor_ms"] / r["gemmconv_ms"])
        assert r["speedup_vs_linear"] == pytest.approx(r["linear_ms"] / r["gemmconv_ms"])
        assert r["floor_ratio"] == pytest.approx(r["floor_ms"] / r["gemmconv_ms"])
        # find keeps the fastest verified candidate
        times = [c["ms"] for c in r["candidates"].values() if c["ok"]]
        assert r["gemmconv_ms"] == min(times)
        assert r["immediate_gap"] == pytest.approx(
            r["candidates"][r["immediate_solver"]]["ms"] / r["gemmconv_ms"] - 1
        )


def test_markdown_table_and_optional_plot(quick_run):
    _, out = quick_run
    md = (out / "cpu.md").read_text()
    data = json.loads((out / "cpu.json").read_text())
    assert md.count("\n| point2d |") == 18
    assert "## Targets" in md and "geometric mean of floor/gemmconv" in md
    assert "QUICK" in md
    assert data["summary"]["rows"] == len(data["rows"])
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (out / "cpu.png").exists() == has_matplotlib


# The rewrite baseline must compute the convolution too, or its times mean nothing.
REWRITE_SHAPES = [
    Shape(2, 3, 5, (8, 6), (4, 3)),
    Shape(2, 3, 5, (9, 7), (4, 3)),  # a remainder no patch covers
    Shape(2, 2, 4, (4, 6, 4), (2, 3, 2)),
    Shape(3, 4, 6, (5, 3), (1, 1)),
]


@pytest.mark.parametrize(
    "shape,layout,direction",
    list(itertools.product(REWRITE_SHAPES, list(Layout), list(Direction))),
)
def test_linear_rewrite_computes_the_convolution(shape, layout, direction):
    p = make_problem(shape, layout, torch.float32, torch.device("cpu"), direction)
    t = make_operands(p, torch.device("cpu"), seed=3)
    result = rewrite_fn(p, t)()
    assert tuple(result.shape) == tuple(VendorSolver().run(p, t).shape)
    assert rms_range(result, reference(p, t)) < 1e-6


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="cases=\\['nope'\\]"):
        suite_cases(["nope"])
    with pytest.raises(SystemExit, match="--layouts"):
        main(["--device", "cpu", "--quick", "--layouts", "nhwc"])


def test_suite_has_the_issue_cases():
    names = [c.name for c in SUITE]
    assert len(names) == 9 and len(set(names)) == 9
    point2d = suite_cases(["point2d"])[0]
    assert point2d.dtypes == ("bf16", "fp16", "fp32")
    assert point2d.full == Shape(9500, 3, 1280, (14, 14), (14, 14))


def test_default_file_stem():
    assert default_stem("NVIDIA H200") == "h200"
    assert default_stem("cpu") == "cpu"


def test_a_spent_time_budget_stops_the_run_and_says_so(tmp_path):
    argv = ["--device", "cpu", "--quick", "--cases", "dit_xl2", "--out", str(tmp_path),
            "--name", "cut", "--time-budget", "0"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "cut.json").read_text())
    assert data["truncated"] and data["rows"] == []
    assert "TRUNCATED" in (tmp_path / "cut.md").read_text()


def test_gather_table_appears_when_rows_carry_gather_times(quick_run):
    from gemmconv.bench_report import markdown, summary

    _, out = quick_run
    data = json.loads((out / "cpu.json").read_text())
    data["rows"][0]["gather"] = {
        "bytes": 4e6, "torch_ms": 0.004, "torch_tbs": 1.0, "triton_ms": 0.001, "triton_tbs": 4.0,
    }  # fmt: skip
    md = markdown(data, summary(data))
    assert "| point2d | cf | 0.0040 | 1.00 | 0.0010 | 4.00 |" in md
