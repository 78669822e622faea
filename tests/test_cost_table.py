"""The cost table (gemmconv.device_rates): every entry complete and sourced, estimates
that never open the find database or measure, the calibration of a CUDA device the
table does not know, outside selection, with a failing database as a miss, and host
costs scaled to the process's host."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest
import torch

import gemmconv
from gemmconv import device_rates, dispatch, finddb, host_speed
from gemmconv.device_rates import CPU, FACTORS, H200, NEAREST_GPU, DeviceRates
from gemmconv.problem import ConvProblem
from gemmconv.solvers import SOLVERS

REPO = Path(__file__).resolve().parents[1]
FUTURE = finddb.Identity("Future GPU", "12.0", torch.__version__, gemmconv.__version__)
MEASURED = DeviceRates("Future GPU", {"bf16": 1000.0, "fp32": 60.0}, 6000.0, 3.0,
                       factors=dict(H200.factors), source="measured")  # fmt: skip


@pytest.mark.parametrize("entry", [H200, CPU], ids=lambda e: e.name)
def test_every_entry_has_every_factor_and_says_where_it_comes_from(entry):
    assert set(entry.factors) == set(FACTORS)
    assert all(0 < v <= 1 for v in entry.factors.values())
    assert entry.source


@pytest.mark.parametrize(
    ("copy", "device"),
    [
        ("h200_suite.json", H200.name),
        ("h200_calls_b9cd4c7.json", H200.name),
        ("h100_calls_74f332e.json", "NVIDIA H100 80GB HBM3"),
    ],
)
def test_the_h200_entry_is_fitted_to_runs_the_tests_hold_copies_of(copy, device):
    assert f"tests/data/{copy}" in H200.source
    run = json.loads((REPO / "tests" / "data" / copy).read_text())
    assert run["device"] == device and len(run["rows"]) == 66


def test_a_missing_factor_is_named_with_the_entry():
    with pytest.raises(KeyError, match="Future GPU .*no fitted factor 'vendor_other'"):
        DeviceRates("Future GPU", {"fp32": 1.0}, 1.0, 1.0).factor("vendor_other")


@pytest.fixture
def unknown_gpu(monkeypatch):
    """A CUDA device the table does not know, on a machine with or without one; its
    identity in the find database is FUTURE, nothing calibrated yet."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Future GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(finddb, "identity_for", lambda device_type, index=None: FUTURE)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(device_rates, "_calibrated", {})
    monkeypatch.setattr(device_rates, "_on_this_host", {})
    measured: list[int] = []

    def measure_rates(index):
        measured.append(index)
        return MEASURED

    monkeypatch.setattr(device_rates, "measure_rates", measure_rates)
    return measured


# The reference launch (a prepared Triton launch) on a host where it costs twice what it
# cost where the H200's host costs were fitted.
SLOW_HOST_LAUNCH_US = 2 * H200.reference_launch_us


@pytest.fixture
def timed_host(monkeypatch):
    """The devices' indices whose host was timed; the host is twice as slow as the
    H200 entry's."""
    timed: list[int] = []

    def measure_reference_launch_us(index):
        timed.append(index)
        return SLOW_HOST_LAUNCH_US

    monkeypatch.setattr(host_speed, "measure_reference_launch_us", measure_reference_launch_us)
    return timed


def _cuda_problem() -> ConvProblem:
    return ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4, dtype=torch.bfloat16,
                                  device_type="cuda")  # fmt: skip


def test_an_estimate_never_opens_the_database_or_measures(unknown_gpu, monkeypatch):
    def no_database():
        raise AssertionError("an estimate opened the find database")

    monkeypatch.setattr(finddb, "get_db", no_database)
    p = _cuda_problem()
    for solver in SOLVERS:
        if solver.is_applicable(p):
            assert solver.estimate_ms(p) == solver.estimate_ms(p, NEAREST_GPU), solver.id
    assert unknown_gpu == []


def test_an_unknown_device_is_calibrated_once_and_its_rates_kept_in_the_database(
    unknown_gpu, timed_host
):
    assert device_rates.rates_for("cuda") is NEAREST_GPU
    device_rates.prepare("cuda")
    device_rates.prepare("cuda")
    assert unknown_gpu == [0] and timed_host == [0]
    assert device_rates.rates_for("cuda") is MEASURED  # its host costs have no reference
    assert finddb.get_db().lookup_rates(FUTURE)["bandwidth_gbs"] == 6000.0
    # A new process finds them in the database and measures nothing but the host.
    device_rates._calibrated.clear()
    device_rates._on_this_host.clear()
    device_rates.prepare("cuda")
    assert unknown_gpu == [0] and device_rates.rates_for("cuda") == MEASURED


def test_nothing_is_calibrated_inside_a_cuda_graph_capture(
    unknown_gpu, timed_host, monkeypatch, caplog
):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.INFO, "gemmconv.device_rates"):
        device_rates.prepare("cuda")
    assert unknown_gpu == [] and timed_host == []
    assert device_rates.rates_for("cuda") is NEAREST_GPU
    assert "not calibrated inside a CUDA graph capture" in caplog.text


def test_a_known_device_is_never_measured_and_its_host_costs_follow_the_host(
    unknown_gpu, timed_host, monkeypatch
):
    device_rates.prepare("cpu")
    assert timed_host == [] and device_rates.rates_for("cpu") is CPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    device_rates.prepare("cuda")
    device_rates.prepare("cuda")
    assert unknown_gpu == [] and timed_host == [0]
    rates = device_rates.rates_for("cuda")
    assert rates == H200.on_host(SLOW_HOST_LAUNCH_US)
    assert rates.matrix_tflops == H200.matrix_tflops and rates.factors == H200.factors
    assert rates.host_launch_us == 2 * H200.host_launch_us
    assert rates.host_triton_launch_us == 2 * H200.host_triton_launch_us
    assert rates.autograd_node_us == 2 * H200.autograd_node_us


def test_under_deterministic_algorithms_the_tables_host_costs_decide(
    unknown_gpu, timed_host, monkeypatch
):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        device_rates.prepare("cuda")
        assert timed_host == [] and device_rates.rates_for("cuda") is H200
        torch.use_deterministic_algorithms(False)
        device_rates.prepare("cuda")  # a later decision outside it times the host
        assert timed_host == [0] and device_rates.rates_for("cuda") != H200
        torch.use_deterministic_algorithms(True)
        assert device_rates.rates_for("cuda") is H200
    finally:
        torch.use_deterministic_algorithms(previous)


def test_the_host_is_not_timed_under_a_sync_debug_mode(unknown_gpu, timed_host, monkeypatch,
                                                        caplog):  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 2)
    with caplog.at_level(logging.INFO, "gemmconv.device_rates"):
        device_rates.prepare("cuda")
    assert timed_host == [] and device_rates.rates_for("cuda") is H200
    assert "not timed under torch.cuda.set_sync_debug_mode" in caplog.text


def test_a_host_that_cannot_be_timed_keeps_the_tables_costs(unknown_gpu, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    attempts = []

    def broken_launch(index):
        attempts.append(index)
        raise RuntimeError("PTX was compiled with an unsupported toolchain")

    monkeypatch.setattr(host_speed, "measure_reference_launch_us", broken_launch)
    with caplog.at_level(logging.WARNING, "gemmconv.device_rates"):
        device_rates.prepare("cuda")
        device_rates.prepare("cuda")
    assert attempts == [0] and device_rates.rates_for("cuda") is H200
    assert "not timed (RuntimeError: PTX was compiled" in caplog.text


def test_an_entry_without_a_reference_host_keeps_its_host_costs():
    assert MEASURED.reference_launch_us is None and MEASURED.on_host(50.0) is MEASURED


def _point_2d_forward() -> ConvProblem:
    # The suite's point 2D row: one 14x14 patch per sample, a 588-wide reduction (not
    # 16-byte aligned in bf16), the case where host and device time are closest.
    return ConvProblem.from_sizes(9500, 3, 1280, (14, 14), 14, stride=14, dtype=torch.bfloat16,
                                  device_type="cuda")  # fmt: skip


def test_a_slower_host_sends_point_2d_back_to_the_one_unaligned_gemm():
    p = _point_2d_forward()
    fast = dispatch.decide(p, rates=H200).solver
    slow = dispatch.decide(p, rates=H200.on_host(SLOW_HOST_LAUNCH_US)).solver
    # On the fitted host the padded reduction's launches cost less than the unaligned
    # GEMM's slowdown (measured there: patch_triton 0.065 ms a call, point_output
    # 0.087); on a host whose Triton launches cost twice as much they cost more (an
    # H100 host: 0.121 against 0.088, tests/data/h100_calls_74f332e.json).
    assert fast in ("patch_triton", "patch_padded")
    assert slow == "point_output"


class _LockedDb:
    def lookup_rates(self, identity):
        raise sqlite3.OperationalError("database is locked")

    def store_rates(self, identity, rates):
        raise sqlite3.OperationalError("database is locked")


def test_a_locked_database_is_a_miss_and_a_result_not_stored(unknown_gpu, monkeypatch, caplog):
    monkeypatch.setattr(finddb, "get_db", _LockedDb)
    with caplog.at_level(logging.WARNING, "gemmconv.device_rates"):
        assert device_rates.calibrate(0) is MEASURED
    assert unknown_gpu == [0]
    assert "unreadable (OperationalError: database is locked); measuring them" in caplog.text
    assert "not stored (OperationalError: database is locked)" in caplog.text


def test_rates_stored_without_factors_take_the_nearest_entrys(unknown_gpu):
    old = {k: v for k, v in MEASURED.as_json().items() if k not in ("factors", "source")}
    finddb.get_db().store_rates(FUTURE, old)
    rates = device_rates.calibrate(0)
    assert unknown_gpu == [] and rates.factors == NEAREST_GPU.factors


def test_rates_stored_before_host_scaling_take_the_nearest_entrys_host_costs(unknown_gpu):
    old = {k: v for k, v in MEASURED.as_json().items() if k != "reference_launch_us"}
    finddb.get_db().store_rates(FUTURE, old)
    rates = device_rates.calibrate(0)
    assert unknown_gpu == [] and rates.bandwidth_gbs == MEASURED.bandwidth_gbs
    assert rates.reference_launch_us == NEAREST_GPU.reference_launch_us
    assert rates.host_launch_us == NEAREST_GPU.host_launch_us != MEASURED.host_launch_us
    assert rates.host_triton_launch_us == NEAREST_GPU.host_triton_launch_us


def test_selection_calibrates_before_its_first_decision(monkeypatch):
    prepared = []
    monkeypatch.setattr(device_rates, "prepare", prepared.append)
    p = ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4)
    dispatch.choose(p)
    dispatch.choose(p)  # decided: nothing to prepare
    assert prepared == ["cpu"]


@pytest.mark.gpu
def test_gpu_measured_rates_are_plausible():
    rates = device_rates.measure_rates(torch.cuda.current_device())
    assert rates.matrix_tflops["bf16"] > rates.matrix_tflops["tf32"] > rates.matrix_tflops["fp32"]
    assert 100.0 < rates.bandwidth_gbs < 20_000.0
    assert rates.factors == NEAREST_GPU.factors and "measured" in rates.source
    assert rates.reference_launch_us == NEAREST_GPU.reference_launch_us
    assert rates.host_triton_launch_us == NEAREST_GPU.host_triton_launch_us


@pytest.mark.gpu
def test_gpu_the_host_is_timed_in_microseconds_a_call():
    us = host_speed.measure_reference_launch_us(torch.cuda.current_device())
    # A prepared Triton launch's host time: 9-18 us on the hosts measured, and never a
    # millisecond.
    assert 1.0 < us < 1000.0
