"""The benchmark runner on the CPU: tiny shapes, the row schema, ratios and files."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest
import torch

from gemmconv import Direction, Layout
from gemmconv.bench import report as bench_report
from gemmconv.bench import suite as bench
from gemmconv.bench.linear_rewrite import rewrite_fn
from gemmconv.bench.report import default_stem, rate_text, speedup_figure
from gemmconv.bench.suite import SUITE, Shape, main, make_problem, suite_cases
from gemmconv.measuring.measure import operands
from gemmconv.measuring.verify import reference, rms_range
from gemmconv.solvers.vendor import VendorSolver
from gemmconv.terminal import progress

from conftest import RecordingBar

REQUIRED = {
    "case", "layout", "direction", "dtype", "solver", "vendor_ms", "linear_ms",
    "gemmconv_ms", "floor_ms", "rms_error", "immediate_solver", "immediate_gap",
    "extra_bytes", "largest_operand_bytes", "flop_floor_ms", "byte_floor_ms",
    "api_ms", "vendor_api_ms", "linear_api_ms", "find_solver", "find_api_ms",
    "find_api_solver", "invariant_api_ms", "invariant_default_api_ms", "invariance_cost",
    "invariant_solver", "invariant",
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
        # find's own pick is the fastest by what a call costs; on the CPU the call time
        # and the device time are one measurement
        calls = {s: c["call_ms"] for s, c in r["candidates"].items() if c["ok"]}
        assert r["find_solver"] == min(calls, key=calls.__getitem__)
        assert all(c["call_ms"] == c["ms"] for c in r["candidates"].values())


def test_every_row_has_what_users_pay_beside_device_time(quick_run):
    _, out = quick_run
    data = json.loads((out / "cpu.json").read_text())
    assert data["timing"]["api"] == {"reps": 2, "block_ms": 0.5}
    for r in data["rows"]:
        assert min(r["api_ms"], r["vendor_api_ms"], r["linear_api_ms"]) > 0, r
        assert r["api_kernels"] is None  # a device profile's count: CUDA only
    md = (out / "cpu.md").read_text()
    table = md[md.index("## What users pay per call (api_ms)") : md.index("## Device time")]
    assert table.count("\n| point2d |") == 18
    targets = md[md.index("## Targets") :]
    assert "- what users pay (api_ms): geometric mean of linear/gemmconv " in targets
    assert "- what users pay (api_ms): rows under 0.97 x vendor or x linear: " in targets
    assert "launches more than 3 kernels (cuBLAS" in targets
    assert "sum counted with their GEMM): not counted" in targets


def test_forward_rows_have_the_invariance_cost(quick_run):
    """Each forward row times the public call with gemmconv.batch_invariant() on beside
    the default call; the report has a section on it with the 10% target."""
    _, out = quick_run
    data = json.loads((out / "cpu.json").read_text())
    for r in data["rows"]:
        if r["direction"] != "fwd":
            assert r["invariance_cost"] is None and r["invariant_api_ms"] is None
            continue
        assert min(r["invariant_api_ms"], r["invariant_default_api_ms"]) > 0, r
        assert r["invariance_cost"] == pytest.approx(
            r["invariant_api_ms"] / r["invariant_default_api_ms"]
        )
        assert r["invariant"] is True, r  # every quick case is GEMM-reducible in bf16..fp32
        assert r["invariant_solver"] in ("patch", "point_output", "pointwise", "strided_pointwise")
    md = (out / "cpu.md").read_text()
    section = md[md.index("## What batch invariance costs") : md.index("## Targets")]
    assert section.count("\n| point2d |") == 6
    assert "- rows over 1.1 x the default call: " in section


def test_api_targets_are_counted_on_the_rows():
    from gemmconv.bench.report import summary

    def row(case, api, vendor, linear):
        return {
            "case": case, "layout": "cf", "direction": "fwd", "dtype": "bf16",
            "api_ms": api, "vendor_api_ms": vendor, "linear_api_ms": linear,
            "floor_ratio": 0.5, "speedup_vs_vendor": 2.0, "speedup_vs_linear": 2.0,
            "immediate_gap": 0.0, "memory_ok": True, "gemmconv_ms": 1.0, "candidates": {},
        }  # fmt: skip

    results = {"rows": [row("a", 1.0, 4.0, 2.0), row("b", 1.0, 0.5, 2.0),
                        row("c", 1.0, 2.0, 0.96)]}  # fmt: skip
    stats = summary(results)
    assert stats["api_slower_than_vendor_or_linear"] == ["b/cf/fwd/bf16", "c/cf/fwd/bf16"]
    assert stats["api_linear_geomean"] == pytest.approx((2.0 * 2.0 * 0.96) ** (1 / 3))
    assert stats["api_vendor_geomean"] == pytest.approx((4.0 * 0.5 * 2.0) ** (1 / 3))
    old = summary({"rows": [{k: v for k, v in r.items() if "api" not in k}
                            for r in results["rows"]]})  # fmt: skip
    assert old["api_rows"] == 0 and old["api_linear_geomean"] is None


def _stats(**changes):
    from gemmconv.bench.report import summary

    row = {
        "case": "a", "layout": "cf", "direction": "fwd", "dtype": "bf16", "api_ms": 1.0,
        "vendor_api_ms": 6.0, "linear_api_ms": 2.0, "floor_ratio": 0.9,
        "speedup_vs_vendor": 2.0, "speedup_vs_linear": 2.0, "immediate_gap": 0.0,
        "memory_ok": True, "gemmconv_ms": 1.0, "candidates": {}, **changes,
    }  # fmt: skip
    return summary({"rows": [row]})


def test_targets_are_counted_and_each_miss_is_named():
    from gemmconv.bench.report import check_status, targets_line, unmet_targets

    # api geomeans (rewrite, cuDNN), api rows, floor geomean, floor minimum, device rows,
    # gaps, memory.
    assert unmet_targets(_stats()) == (8, [])
    checked, unmet = unmet_targets(_stats(floor_ratio=0.3, linear_api_ms=0.5, vendor_api_ms=4.0))
    assert checked == 8 and unmet == [
        "api linear/gemmconv geomean 0.500 < 1.6",
        "api vendor/gemmconv geomean 4.000 < 5.0",
        "1 row(s) under 0.97 x vendor or x linear (api)",
        "floor/gemmconv geomean 0.300 < 0.7",
        "floor/gemmconv minimum 0.300 < 0.4",
    ]
    assert targets_line(checked, unmet, quick=False) == (
        "targets: 5 of 8 NOT met: " + "; ".join(unmet)
    )
    assert targets_line(8, [], quick=False) == "targets: all 8 met"
    assert targets_line(0, [], quick=False) == "targets: none checked (no rows ran)"
    assert [check_status(7, []), check_status(7, unmet), check_status(0, [])] == [0, 1, 1]


def test_the_last_line_says_whether_the_targets_are_met(tmp_path, monkeypatch, capsys):
    argv = ["--device", "cpu", "--quick", "--cases", "dit_xl2", "--layouts", "cf",
            "--directions", "fwd", "--warmup", "0", "--reps", "1",
            "--out", str(tmp_path), "--no-plot"]  # fmt: skip
    monkeypatch.setattr(bench_report, "FLOOR_GEOMEAN", float("inf"))
    assert main(argv) == 0  # without --check, a target not met is reported only
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("targets: ") and " NOT met (a quick run: tiny sizes, not a " in last
    assert "floor/gemmconv geomean " in last and " < inf" in last
    assert main([*argv, "--check"]) == 1
    monkeypatch.setattr(bench_report, "unmet_targets", lambda stats: (4, []))
    assert main([*argv, "--check"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "targets: all 4 met (a quick run: tiny sizes, not a measurement)"


def test_the_other_benchmarks_flags_are_routed_not_run_by_the_suite(capsys):
    assert main(["--device", "cpu", "--api"]) == 2
    assert "--api: a benchmark of its own; run it as `gemmconv bench --api`" in (
        capsys.readouterr().err
    )


def test_markdown_table_and_optional_plot(quick_run):
    _, out = quick_run
    md = (out / "cpu.md").read_text()
    data = json.loads((out / "cpu.json").read_text())
    # The public-call table and the device table, and the invariance table's forwards.
    assert md.count("\n| point2d |") == 2 * 18 + 6
    assert "## Targets" in md and "geometric mean of floor/gemmconv" in md
    assert "QUICK" in md
    assert data["summary"]["rows"] == len(data["rows"])
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (out / "cpu.png").exists() == has_matplotlib


def test_a_cpu_report_says_what_was_measured(quick_run):
    """On the CPU: perf_counter timing with no flush, aten's CPU convolution as the
    vendor, and matrix rates in a unit that shows them."""
    _, out = quick_run
    md = (out / "cpu.md").read_text()
    header = md[md.index("## Device time") : md.index("| case | layout | dir | dtype | solver")]
    assert "time.perf_counter, no cache flush" in header and "vendor = aten CPU" in header
    assert "CUDA events" not in header and "cuDNN" not in header
    assert "0.0 TFLOP/s" not in header and "GFLOP/s" in header
    assert rate_text(0.0316) == "31.6 GFLOP/s" and rate_text(780.0) == "780.0 TFLOP/s"


def test_the_plot_legend_covers_no_bar(quick_run):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    _, out = quick_run
    fig = speedup_figure(json.loads((out / "cpu.json").read_text()))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    legend = fig.legends[0] if fig.legends else ax.get_legend()
    box = legend.get_window_extent(renderer)
    for other in (ax, ax.title, ax.xaxis.label):
        assert not box.overlaps(other.get_window_extent(renderer)), other
    assert "aten CPU" in ax.get_xlabel()
    plt.close(fig)


def test_results_go_to_a_folder_of_their_own_by_default(tmp_path, monkeypatch, capsys):
    """Run from a checkout's root, the default never writes over bench/results."""
    monkeypatch.chdir(tmp_path)
    argv = ["--device", "cpu", "--quick", "--cases", "dit_xl2", "--name", "here",
            "--time-budget", "0"]  # fmt: skip
    assert main(argv) == 0
    assert (tmp_path / "gemmconv-bench" / "here.json").exists()
    assert not (tmp_path / "bench").exists()


def test_a_missing_matplotlib_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_report, "plot", lambda results, path: False)
    argv = ["--device", "cpu", "--quick", "--cases", "dit_xl2", "--layouts", "cf",
            "--directions", "fwd", "--warmup", "0", "--reps", "1",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no png: matplotlib is not installed (pip install 'gemmconv[bench]')" in out
    assert not list(tmp_path.glob("*.png"))


def test_cases_without_the_asked_dtype_are_named(tmp_path, capsys):
    argv = ["--device", "cpu", "--quick", "--cases", "vit_b16,point2d", "--dtypes", "fp32",
            "--layouts", "cf", "--directions", "fwd", "--warmup", "0", "--reps", "1",
            "--out", str(tmp_path), "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note: vit_b16 has no fp32 rows (its dtypes: bf16)" in out
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]
    assert [(r["case"], r["dtype"]) for r in rows] == [("point2d", "fp32")]


def test_the_bench_bar_counts_rows_on_a_terminal(tmp_path, monkeypatch, capsys):
    argv = ["--device", "cpu", "--quick", "--cases", "dit_xl2", "--layouts", "cf",
            "--directions", "fwd,bwd_data", "--warmup", "0", "--reps", "1",
            "--out", str(tmp_path), "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # not a terminal: no bar
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "bench:" in captured.err and "/2 " in captured.err
    assert "dit_xl2 cf fwd" in captured.out  # row lines still reach stdout
    bars = RecordingBar.patch(monkeypatch, bench)
    assert main(argv) == 0
    assert [(b.desc, b.total, b.n) for b in bars] == [("bench", 2, 2)]


def test_a_long_cpu_bench_is_announced_before_it_starts(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # stands for the run itself

    monkeypatch.setattr(bench, "run_suite", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["--device", "cpu", "--cases", "sam_vit_h", "--layouts", "cf"])
    err = capsys.readouterr().err
    assert err.startswith("gemmconv bench: warning: this run may take up to ")
    assert "--quick" in err
    with pytest.raises(KeyboardInterrupt):
        main(["--device", "cpu", "--quick", "--cases", "sam_vit_h", "--layouts", "cf"])
    assert capsys.readouterr().err == ""  # tiny shapes: foreseen as short


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
    t = operands(p, torch.device("cpu"), seed=3)
    result = rewrite_fn(p, t)()
    assert tuple(result.shape) == tuple(VendorSolver().run(p, t).shape)
    assert rms_range(result, reference(p, t)) < 1e-6


def test_unknown_names_are_refused(capsys):
    with pytest.raises(ValueError, match="cases=\\['nope'\\]"):
        suite_cases(["nope"])
    assert main(["--device", "cpu", "--quick", "--layouts", "nhwc"]) == 2
    assert capsys.readouterr().err == (
        "gemmconv bench: error: --layouts nhwc: unknown nhwc; expected a comma list of cf, cl\n"
    )


def test_suite_has_the_issue_cases():
    names = [c.name for c in SUITE]
    assert len(names) == 13 and len(set(names)) == 13
    point2d = suite_cases(["point2d"])[0]
    assert point2d.dtypes == ("bf16", "fp16", "fp32")
    assert point2d.full == Shape(9500, 3, 1280, (14, 14), (14, 14))


# The classes that lost to cuDNN (issue 44), shapes of released models: Conv3d embeds
# with a temporal kernel of 2, a (1, 2, 2) video-latent patchify and a 2x2 latent
# patchify of 16 channels.
RELEASED = {
    "qwen2vl": Shape(8192, 3, 1280, (2, 14, 14), (2, 14, 14)),
    "qwen3vl": Shape(8192, 3, 1152, (2, 16, 16), (2, 16, 16)),
    "wan21_patchify": Shape(1, 16, 5120, (21, 60, 104), (1, 2, 2)),
    "sd3_patchify": Shape(8, 16, 1536, (128, 128), (2, 2)),
}


def test_suite_has_the_released_models_that_lost_to_cudnn():
    for case in suite_cases(list(RELEASED)):
        assert case.full == RELEASED[case.name], case.name
        # The tiny shape keeps the class: channels, kernel and rank.
        assert (case.tiny.c, case.tiny.kernel) == (case.full.c, case.full.kernel), case.name
        assert len(case.tiny.spatial) == len(case.full.spatial)


def test_qwen3vl_case_follows_the_transformers_config():
    config = pytest.importorskip("transformers").Qwen3VLVisionConfig()
    (case,) = suite_cases(["qwen3vl"])
    assert case.full.c == config.in_channels and case.full.k == config.hidden_size
    assert case.full.kernel == (config.temporal_patch_size, config.patch_size, config.patch_size)


def test_quick_cpu_run_covers_the_released_cases_in_both_layouts(tmp_path):
    argv = ["--device", "cpu", "--quick", "--cases", ",".join(RELEASED), "--warmup", "0",
            "--reps", "1", "--out", str(tmp_path), "--name", "new", "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((tmp_path / "new.json").read_text())["rows"]
    assert len(rows) == len(RELEASED) * 2 * 3
    assert {(r["case"], r["layout"], r["direction"]) for r in rows} == {
        (name, layout, direction)
        for name in RELEASED
        for layout in ("cf", "cl")
        for direction in ("fwd", "bwd_data", "bwd_weights")
    }
    for r in rows:
        assert r["verified"] and all(c["ok"] for c in r["candidates"].values()), r["case"]


def test_default_file_stem():
    assert default_stem("NVIDIA H200") == "h200"
    assert default_stem("cpu") == "cpu"


def test_a_spent_time_budget_stops_the_run_and_says_so(tmp_path):
    argv = ["--device", "cpu", "--quick", "--cases", "dit_xl2", "--out", str(tmp_path),
            "--name", "cut", "--time-budget", "0"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "cut.json").read_text())
    assert data["truncated"] and data["rows"] == []
    md = (tmp_path / "cut.md").read_text()
    assert "TRUNCATED" in md
    assert "- no rows were run: the time budget was spent before the first row" in md


def test_gather_table_appears_when_rows_carry_gather_times(quick_run):
    from gemmconv.bench.report import markdown, summary

    _, out = quick_run
    data = json.loads((out / "cpu.json").read_text())
    data["rows"][0]["gather"] = {
        "bytes": 4e6, "torch_ms": 0.004, "torch_tbs": 1.0, "triton_ms": 0.001, "triton_tbs": 4.0,
    }  # fmt: skip
    md = markdown(data, summary(data))
    assert "| point2d | cf | 0.0040 | 1.00 | 0.0010 | 4.00 |" in md


def test_find_api_ms_is_the_public_call_in_find_mode(quick_run):
    """Each row has find mode's public call, timed after find ran, beside the default's;
    the report shows the column and its target line."""
    _, out = quick_run
    data = json.loads((out / "cpu.json").read_text())
    for r in data["rows"]:
        assert r["find_api_ms"] > 0, r["case"]
        assert r["find_api_solver"] is None or r["find_api_solver"] in r["candidates"]
    md = (out / "cpu.md").read_text()
    assert "| find | find's pick | kernels |" in md
    assert "- find mode (find_api_ms): rows over 1.05 x the default selection's call:" in md


@pytest.mark.parametrize("direction", list(Direction))
def test_find_columns_find_in_a_database_of_their_own(direction):
    """api_times(find=True) finds the row's problem and times its call in find mode,
    storing nothing in the user's database (the default mode's later calls read it)."""
    from gemmconv.bench.call_timing import api_times
    from gemmconv.selection import dispatch, finddb

    p = make_problem(Shape(2, 3, 8, (8, 8), (4, 4)), Layout.CHANNELS_LAST, torch.float32,
                     torch.device("cpu"), direction)  # fmt: skip
    columns = api_times(p, "cpu", reps=1, warmup=0, find=True)
    assert columns["find_api_ms"] > 0 and columns["api_ms"] > 0
    assert columns["find_api_solver"] is not None
    with dispatch.find_mode("find"):
        assert dispatch.decided(p).source == "find"
    assert finddb.get_db().lookup(dispatch.database_key(p), finddb.identity_for("cpu")) is None
    assert dispatch.current_find_mode() is dispatch.FindMode.DATABASE


def test_find_columns_time_a_graph_built_after_find_decided(monkeypatch):
    """A backward call's graph is built once and retained: the find-mode graph that is
    timed must be built once find has decided the row's problem, not during its trials
    (whose forward may keep what the final pick does not use)."""
    from gemmconv.bench import call_timing
    from gemmconv.selection import dispatch

    p = make_problem(Shape(2, 3, 8, (8, 8), (4, 4)), Layout.CHANNELS_LAST, torch.float32,
                     torch.device("cpu"), Direction.BACKWARD_WEIGHTS)  # fmt: skip
    decided_at_build = []
    build = call_timing.public_calls

    def recording(problem, kind, operands):
        if dispatch.current_find_mode() is dispatch.FindMode.FIND:
            decided_at_build.append(dispatch.decided(p) is not None)
        return build(problem, kind, operands)

    monkeypatch.setattr(call_timing, "public_calls", recording)
    call_timing.api_times(p, "cpu", reps=1, warmup=0, find=True)
    assert decided_at_build and decided_at_build[-1], decided_at_build
