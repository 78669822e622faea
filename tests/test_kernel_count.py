"""What one public call launches on the device (gemmconv.kernel_count) and how the
suite reports it against the three-launch target."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch.autograd import DeviceType

from gemmconv import bench_report
from gemmconv.kernel_count import MAX_KERNELS, device_kernels, kernels_per_call


def _event(device_type):
    return types.SimpleNamespace(device_type=device_type)


def test_only_the_device_side_records_count():
    events = [_event(DeviceType.CPU), _event(DeviceType.CUDA), _event(DeviceType.CUDA),
              types.SimpleNamespace()]  # fmt: skip
    assert device_kernels(events) == 2
    assert device_kernels([]) == 0


def test_nothing_is_counted_off_cuda():
    ran = []
    assert kernels_per_call(lambda: ran.append(1), torch.device("cpu")) is None
    assert ran == []  # not even run: there is no device record to take


def _row(case: str, kernels: int | None) -> dict:
    return {
        "case": case, "layout": "cf", "direction": "fwd", "dtype": "bf16",
        "api_ms": 0.1, "vendor_api_ms": 0.2, "linear_api_ms": 0.15, "api_kernels": kernels,
        "floor_ratio": 0.5, "speedup_vs_vendor": 2.0, "speedup_vs_linear": 1.5,
        "immediate_gap": 0.0, "memory_ok": True, "gemmconv_ms": 0.1,
    }  # fmt: skip


def test_the_summary_names_the_rows_over_the_target():
    results = {"rows": [_row("a", MAX_KERNELS), _row("b", MAX_KERNELS + 2), _row("c", None)]}
    stats = bench_report.summary(results)
    assert stats["kernels_counted"] == 2
    assert stats["api_over_max_kernels"] == ["b/cf/fwd/bf16"]
    line = bench_report._kernels_line(stats)
    assert "1 of 2 counted" in line and "b/cf/fwd/bf16" in line


def test_a_run_without_counts_says_so():
    stats = bench_report.summary({"rows": [_row("a", None)]})
    assert "not counted" in bench_report._kernels_line(stats)


def test_the_public_call_table_shows_the_count():
    lines = bench_report._api_table({"rows": [_row("a", 2), _row("c", None)]})
    assert any("| kernels |" in line for line in lines)
    (a,) = [line for line in lines if line.startswith("| a |")]
    (c,) = [line for line in lines if line.startswith("| c |")]
    assert a.endswith("| 2 |") and c.endswith("| — |")


@pytest.mark.gpu
def test_one_matrix_product_is_one_kernel_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = torch.randn(256, 256, device="cuda")
    torch.mm(a, a)  # warm: cuBLAS's handle and workspace
    assert kernels_per_call(lambda: torch.mm(a, a), torch.device("cuda")) == 1
    assert kernels_per_call(lambda: a.add_(1.0), torch.device("cuda")) == 1


@pytest.mark.gpu
def test_a_suite_rows_public_call_is_counted_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from gemmconv.api_timing import public_call_kernels
    from gemmconv.bench import SUITE, make_problem
    from gemmconv.memory_format import Layout
    from gemmconv.problem import Direction

    case = next(c for c in SUITE if c.name == "vit_b16")
    p = make_problem(case.tiny, Layout.CHANNELS_LAST, torch.bfloat16, torch.device("cuda"),
                     Direction.FORWARD)  # fmt: skip
    kernels = public_call_kernels(p, "cuda")
    assert kernels is not None and kernels >= 1


def test_a_failed_count_costs_the_suite_nothing(monkeypatch, tmp_path):
    from gemmconv import api_timing
    from gemmconv.bench import main

    def broken(*args, **kwargs):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(api_timing, "public_call_kernels", broken)
    out = tmp_path / "suite"
    assert main(["--device", "cpu", "--quick", "--cases", "resnet_1x1", "--layouts", "cl",
                 "--directions", "fwd", "--warmup", "0", "--reps", "1", "--out", str(out),
                 "--name", "cpu"]) == 0  # fmt: skip
    (row,) = json.loads((out / "cpu.json").read_text())["rows"]
    assert row["api_kernels"] is None and row["api_ms"] > 0
