"""What one public call launches on the device (gemmconv.bench.kernel_count) and how the
suite reports it against the three-launch target."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch.autograd import DeviceType

from gemmconv.bench import report as bench_report
from gemmconv.bench.kernel_count import (
    MAX_KERNELS,
    device_kernels,
    kernels_per_call,
    launched_kernels,
    launches,
)


def _event(device_type, name="k"):
    return types.SimpleNamespace(device_type=device_type, name=name)


def test_only_the_device_side_records_count():
    events = [_event(DeviceType.CPU, "aten::mm"), _event(DeviceType.CUDA, "gemm"),
              _event(DeviceType.CUDA, "Memset (Device)"), types.SimpleNamespace()]  # fmt: skip
    assert device_kernels(events) == ["gemm", "Memset (Device)"]
    assert device_kernels([]) == []


def test_nothing_is_counted_off_cuda():
    ran = []
    assert kernels_per_call(lambda: ran.append(1), torch.device("cpu")) is None
    assert launched_kernels(lambda: ran.append(1), torch.device("cpu")) is None
    assert ran == []  # not even run: there is no device record to take


def _row(case: str, kernels: int | None) -> dict:
    names = None if kernels is None else [f"void k{i}<float, 128>(Params)" for i in range(kernels)]
    return {
        "case": case, "layout": "cf", "direction": "fwd", "dtype": "bf16",
        "api_ms": 0.1, "vendor_api_ms": 0.2, "linear_api_ms": 0.15, "api_kernels": kernels,
        "api_kernel_names": names,
        "floor_ratio": 0.5, "speedup_vs_vendor": 2.0, "speedup_vs_linear": 1.5,
        "immediate_gap": 0.0, "memory_ok": True, "gemmconv_ms": 0.1,
    }  # fmt: skip


def test_the_summary_names_the_rows_over_the_target():
    results = {"rows": [_row("a", MAX_KERNELS), _row("b", MAX_KERNELS + 2), _row("c", None)]}
    stats = bench_report.summary(results)
    assert stats["kernels_counted"] == 2
    assert stats["api_over_max_kernels"] == ["b/cf/fwd/bf16"]
    line, names = bench_report._kernels_lines(stats)
    assert "1 of 2 counted" in line and "b/cf/fwd/bf16" in line
    # What the row over the target launched, each kernel by its short name.
    assert names == "  - b/cf/fwd/bf16: k0; k1; k2; k3; k4"


def test_a_kernel_name_loses_its_template_and_parameters():
    assert bench_report.short_kernel_name("void cutlass::Kernel2<cutlass_80_tensorop>(Params)") == (
        "cutlass::Kernel2"
    )
    assert bench_report.short_kernel_name("Memset (Device)") == "Memset"
    assert bench_report.short_kernel_name("_patch_gemm_kernel") == "_patch_gemm_kernel"


def test_a_run_without_counts_says_so():
    stats = bench_report.summary({"rows": [_row("a", None)]})
    (line,) = bench_report._kernels_lines(stats)
    assert "not counted" in line


def test_the_public_call_table_shows_the_count():
    lines = bench_report._api_table({"rows": [_row("a", 2), _row("c", None)]})
    assert any("| kernels |" in line for line in lines)
    (a,) = [line for line in lines if line.startswith("| a |")]
    (c,) = [line for line in lines if line.startswith("| c |")]
    assert a.endswith("| 2 |") and c.endswith("| — |")


def test_cublas_helpers_count_with_their_gemm():
    names = ["_permute_kernel", "Memset (Device)", "nvjet_sm90_tst_192x128_TNT",
             "void cublasLt::splitKreduce_kernel<32, 16, int>(Params)"]  # fmt: skip
    assert launches(names) == 2
    row = {**_row("b", 4), "api_kernel_names": names}
    stats = bench_report.summary({"rows": [row]})
    assert stats["api_over_max_kernels"] == []  # 4 kernels, 2 launches
    (line,) = [x for x in bench_report._api_table({"rows": [row]}) if x.startswith("| b |")]
    assert line.endswith("| 4 (2) |")


@pytest.mark.gpu
def test_elementwise_ops_count_one_kernel_each_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # Elementwise ops, one kernel each: a matrix product may launch two (an H100 ran a
    # 256x256 fp32 torch.mm as two kernels), which says nothing of the count.
    a = torch.randn(256, 256, device="cuda")
    device = torch.device("cuda")
    a.add_(1.0)
    assert kernels_per_call(lambda: a.add_(1.0), device) == 1
    assert kernels_per_call(lambda: (a.add_(1.0), a.mul_(0.5)), device) == 2
    names = launched_kernels(lambda: torch.mm(a, a), device)
    assert names and all(isinstance(n, str) and n for n in names)


@pytest.mark.gpu
def test_a_suite_rows_public_call_is_counted_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from gemmconv.bench.call_timing import public_call_kernels
    from gemmconv.bench.suite import SUITE, make_problem
    from gemmconv.core.memory_format import Layout
    from gemmconv.core.problem import Direction

    case = next(c for c in SUITE if c.name == "vit_b16")
    p = make_problem(case.tiny, Layout.CHANNELS_LAST, torch.bfloat16, torch.device("cuda"),
                     Direction.FORWARD)  # fmt: skip
    names = public_call_kernels(p, "cuda")
    assert names and all(isinstance(n, str) for n in names)


def test_a_failed_count_costs_the_suite_nothing(monkeypatch, tmp_path):
    from gemmconv.bench import call_timing as api_timing
    from gemmconv.bench.suite import main

    def broken(*args, **kwargs):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(api_timing, "public_call_kernels", broken)
    out = tmp_path / "suite"
    assert main(["--device", "cpu", "--quick", "--cases", "resnet_1x1", "--layouts", "cl",
                 "--directions", "fwd", "--warmup", "0", "--reps", "1", "--out", str(out),
                 "--name", "cpu"]) == 0  # fmt: skip
    (row,) = json.loads((out / "cpu.json").read_text())["rows"]
    assert row["api_kernels"] is None and row["api_ms"] > 0


def test_a_count_stores_the_kernels_names(monkeypatch, tmp_path):
    from gemmconv.bench import call_timing as api_timing
    from gemmconv.bench.suite import main

    monkeypatch.setattr(api_timing, "public_call_kernels", lambda *a, **k: ["gather", "gemm"])
    out = tmp_path / "suite"
    assert main(["--device", "cpu", "--quick", "--cases", "resnet_1x1", "--layouts", "cl",
                 "--directions", "fwd", "--warmup", "0", "--reps", "1", "--out", str(out),
                 "--name", "cpu"]) == 0  # fmt: skip
    (row,) = json.loads((out / "cpu.json").read_text())["rows"]
    assert row["api_kernels"] == 2 and row["api_kernel_names"] == ["gather", "gemm"]
