"""The cost table (gemmconv.core.device_rates): every entry complete and sourced, estimates
that never open the find database or measure, and the calibration of a CUDA device the
table does not know (gemmconv.selection.calibrate), outside selection, with a failing
database as a miss."""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
from pathlib import Path

import pytest
import torch

import gemmconv
from gemmconv.core import device_rates
from gemmconv.core.device_rates import CPU, FACTORS, H200, NEAREST_GPU, DeviceRates
from gemmconv.core.problem import ConvProblem
from gemmconv.selection import calibrate, dispatch, finddb
from gemmconv.solvers import SOLVERS

REPO = Path(__file__).resolve().parents[2]
FUTURE = finddb.Identity("Future GPU", "12.0", torch.__version__, gemmconv.__version__)
MEASURED = DeviceRates("Future GPU", {"bf16": 1000.0, "fp32": 60.0}, 6000.0, 3.0,
                       factors=dict(H200.factors), source="measured")  # fmt: skip


@pytest.mark.parametrize("entry", [H200, CPU], ids=lambda e: e.name)
def test_every_entry_has_every_factor_and_says_where_it_comes_from(entry):
    assert set(entry.factors) == set(FACTORS)
    # A fraction of the floor at the device's measured rates; the CPU entry's rates are
    # conservative, so oneDNN's factors there may pass 1 (device_rates.CPU says why).
    ceiling = 3.0 if entry is CPU else 1.0
    assert all(0 < v <= ceiling for v in entry.factors.values())
    assert entry.source


@pytest.mark.parametrize(
    ("copy", "device", "rows"),
    [("h200_suite.json", "NVIDIA H200", 66), ("h100_suite.json", "NVIDIA H100 80GB HBM3", 90)],
)
def test_the_h200_entry_is_fitted_to_runs_the_tests_hold_copies_of(copy, device, rows):
    """The H200 entry (which prices the H100 too) names the tests' copies of both runs
    it is fitted to, and each copy is that card's whole suite."""
    assert f"tests/data/{copy}" in H200.source
    run = json.loads((REPO / "tests" / "data" / copy).read_text())
    assert run["device"] == device and len(run["rows"]) == rows
    assert device_rates._TABLE[device] is H200


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
    monkeypatch.setattr(device_rates, "_calibrated", {})
    measured: list[int] = []

    def measure_rates(index):
        measured.append(index)
        return MEASURED

    monkeypatch.setattr(calibrate, "measure_rates", measure_rates)
    return measured


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


def test_an_unknown_device_is_calibrated_once_and_its_rates_kept_in_the_database(unknown_gpu):
    assert device_rates.rates_for("cuda") is NEAREST_GPU
    calibrate.prepare("cuda")
    calibrate.prepare("cuda")
    assert unknown_gpu == [0]
    assert device_rates.rates_for("cuda") is MEASURED
    assert finddb.get_db().lookup_rates(FUTURE)["bandwidth_gbs"] == 6000.0
    # A new process finds them in the database and measures nothing.
    device_rates._calibrated.clear()
    calibrate.prepare("cuda")
    assert unknown_gpu == [0] and device_rates.rates_for("cuda") == MEASURED


def test_nothing_is_calibrated_inside_a_cuda_graph_capture(unknown_gpu, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with caplog.at_level(logging.INFO, "gemmconv.device_rates"):
        calibrate.prepare("cuda")
    assert unknown_gpu == [] and device_rates.rates_for("cuda") is NEAREST_GPU
    assert "not calibrated inside a CUDA graph capture" in caplog.text


def test_a_known_device_and_the_cpu_are_never_calibrated(unknown_gpu, monkeypatch):
    calibrate.prepare("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    calibrate.prepare("cuda")
    assert unknown_gpu == [] and device_rates.rates_for("cuda") is H200


def _two_ranks(monkeypatch, rank: int, other: tuple | None = None) -> list:
    """torch.distributed as a process group of two ranks, this one ``rank``, whose
    all_gather_object sets ``other`` as the other rank's contribution; returns the
    list the gather puts this rank's contribution in."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    sent: list = []

    def all_gather_object(out, obj, group=None):
        sent.append(obj)
        out[rank], out[1 - rank] = obj, other

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    return sent


def test_no_rank_calibrates_on_its_own_in_a_distributed_run(unknown_gpu, monkeypatch):
    # Each rank's measurement differs; the nearest entry is the same on every rank.
    _two_ranks(monkeypatch, 1)
    calibrate.prepare("cuda")
    assert unknown_gpu == [] and device_rates.rates_for("cuda") is NEAREST_GPU


def test_sync_choices_calibrates_on_rank_zero_and_shares_the_rates(unknown_gpu, monkeypatch):
    sent = _two_ranks(monkeypatch, 0, other=([], {}))
    gemmconv.sync_choices()
    assert unknown_gpu == [0] and sent[0][1] == {0: MEASURED}
    assert device_rates.rates_for("cuda") is MEASURED


def test_sync_choices_takes_rank_zeros_rates_without_measuring(unknown_gpu, monkeypatch):
    theirs = dataclasses.replace(MEASURED, bandwidth_gbs=5000.0)
    _two_ranks(monkeypatch, 1, other=([], {0: theirs}))
    gemmconv.sync_choices()
    assert unknown_gpu == [] and device_rates.rates_for("cuda") is theirs


class _LockedDb:
    def lookup_rates(self, identity):
        raise sqlite3.OperationalError("database is locked")

    def store_rates(self, identity, rates):
        raise sqlite3.OperationalError("database is locked")


def test_a_locked_database_is_a_miss_and_a_result_not_stored(unknown_gpu, monkeypatch, caplog):
    monkeypatch.setattr(finddb, "get_db", _LockedDb)
    with caplog.at_level(logging.WARNING, "gemmconv.device_rates"):
        assert calibrate.calibrate(0) is MEASURED
    assert unknown_gpu == [0]
    assert "unreadable (OperationalError: database is locked); measuring them" in caplog.text
    assert "not stored (OperationalError: database is locked)" in caplog.text


def test_rates_stored_without_factors_take_the_nearest_entrys(unknown_gpu):
    old = {k: v for k, v in MEASURED.as_json().items() if k not in ("factors", "source")}
    finddb.get_db().store_rates(FUTURE, old)
    rates = calibrate.calibrate(0)
    assert unknown_gpu == [] and rates.factors == NEAREST_GPU.factors


def test_rates_stored_before_a_factor_was_added_take_that_one_from_the_nearest_entry(
    unknown_gpu,
):
    stored = MEASURED.as_json()
    del stored["factors"]["vendor_few_channel_patch"]
    stored["factors"]["vendor_other"] = 0.123  # what was stored stays
    finddb.get_db().store_rates(FUTURE, stored)
    rates = calibrate.calibrate(0)
    assert unknown_gpu == []
    added = "vendor_few_channel_patch"
    assert rates.factor(added) == NEAREST_GPU.factor(added)
    assert rates.factor("vendor_other") == 0.123


def test_selection_calibrates_before_its_first_decision(monkeypatch):
    prepared = []
    monkeypatch.setattr(calibrate, "prepare", prepared.append)
    p = ConvProblem.from_sizes(4, 3, 8, (8, 8), 4, stride=4)
    dispatch.choose(p)
    dispatch.choose(p)  # decided: nothing to prepare
    assert prepared == ["cpu"]


@pytest.mark.gpu
def test_gpu_measured_rates_are_plausible():
    rates = calibrate.measure_rates(torch.cuda.current_device())
    assert rates.matrix_tflops["bf16"] > rates.matrix_tflops["tf32"] > rates.matrix_tflops["fp32"]
    assert 100.0 < rates.bandwidth_gbs < 20_000.0
    assert rates.factors == NEAREST_GPU.factors and "measured" in rates.source
