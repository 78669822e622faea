"""The suite's fp8 rows on the CPU: where fp8 does not apply the row says why and times
nothing; with the fp8 run let onto the CPU (core.float8's test switch) every variant is
timed, the speed-up follows from the times, and the report and targets show them."""

from __future__ import annotations

import json

import pytest
import torch

from gemmconv.bench import fp8_rows
from gemmconv.bench.report import summary, unmet_targets
from gemmconv.bench.suite import SUITE, main
from gemmconv.core import float8 as core_float8
from gemmconv.roads import float8 as road_float8

CASES = [c for c in SUITE if c.name in fp8_rows.CASES]


def test_off_cuda_the_rows_say_why_and_time_nothing():
    rows = fp8_rows.fp8_rows(CASES, torch.device("cpu"), quick=True, reps=1, block_ms=1.0,
                             log=lambda line: None)  # fmt: skip
    assert [r["case"] for r in rows] == list(fp8_rows.CASES)
    for row in rows:
        assert row["applies"] is False and "ms" not in row
        assert "CUDA" in row["note"], row["note"]
    stats = summary({"rows": [], "fp8_rows": rows})
    assert stats["fp8_rows_run"] == 0
    section = fp8_rows.fp8_section({"fp8_rows": rows})
    assert all(f"| {r['case']} |" in "\n".join(section) for r in rows)
    assert sum("not run:" in line for line in section) == len(rows)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    # Decisions are kept per operand metadata: those made with the switch off go.
    road_float8.clear_decisions()
    monkeypatch.setattr(core_float8, "_RUN_ON_CPU_FOR_TESTS", True)
    yield
    road_float8.clear_decisions()


def test_every_variant_is_timed_where_fp8_runs(fp8_on_cpu):
    row = fp8_rows.fp8_row(CASES[1], torch.device("cpu"), quick=True, reps=1, block_ms=1.0)
    assert row["applies"] is True
    assert set(row["ms"]) == set(fp8_rows.VARIANTS)
    assert all(ms > 0 for ms in row["ms"].values())
    assert row["fp8_speedup"] == pytest.approx(
        row["ms"]["gemmconv bf16"] / row["ms"]["gemmconv fp8"]
    )
    slow = dict(row, fp8_speedup=fp8_rows.FP8_TARGET - 0.01)
    fast = dict(row, fp8_speedup=fp8_rows.FP8_TARGET)
    for rows, missed in (([slow], True), ([fast], False)):
        checked, unmet = unmet_targets(summary({"rows": [], "fp8_rows": rows}))
        assert checked == 1
        assert bool(unmet) is missed and (not missed or "fp8" in unmet[0])
    lines = "\n".join(fp8_rows.fp8_section({"fp8_rows": [row]}))
    assert f"{row['fp8_speedup']:.2f} |" in lines


def test_the_suite_writes_the_fp8_rows(tmp_path, fp8_on_cpu):
    code = main(["--device", "cpu", "--quick", "--cases", "vit_b16", "--layouts", "cf",
                 "--directions", "fwd", "--warmup", "0", "--reps", "1", "--out", str(tmp_path),
                 "--name", "cpu", "--no-plot"])  # fmt: skip
    assert code in (0, 1)  # 1: a target not met is still a complete run
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert [r["case"] for r in results["fp8_rows"]] == ["vit_b16"]
    assert results["fp8_rows"][0]["applies"] is True
    assert "## fp8 patch embeds" in (tmp_path / "cpu.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device of compute capability 8.9 or later",
)
def test_the_fp8_rows_run_on_cuda():
    road_float8.clear_decisions()
    rows = fp8_rows.fp8_rows(CASES, torch.device("cuda"), quick=True, reps=2, block_ms=1.0,
                             log=lambda line: None)  # fmt: skip
    for row in rows:
        assert row["applies"] is True, row["note"]
        assert set(row["ms"]) == set(fp8_rows.VARIANTS) and row["fp8_speedup"] > 0
