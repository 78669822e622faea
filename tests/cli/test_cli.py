"""The ``gemmconv`` driver: output, exit codes, --json, bad flags, forced/disabled solvers,
every selection mode, the database commands, tune, demo and bench."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from gemmconv.cli import commands as cli
from gemmconv.selection import dispatch, finddb
from gemmconv.solvers.im2col import Im2colSolver
from gemmconv.terminal import progress

from conftest import RecordingBar
from find_counting import is_finds_pick

# The CPU path: --device auto would take a CUDA device where one is present (in bf16).
CPU = ["--device", "cpu"]
# A small patch-class problem: patch, im2col and vendor apply in every direction.
PATCH = [*CPU, *"-n 4 -c 3 -H 16 -W 16 -k 16 -y 2 -x 2 -u 2 -v 2 -i 2 --warmup 0".split()]
# One patch per sample: a GEMM solver (point_output) is picked in every direction, where
# the CPU's oneDNN takes PATCH's small patches.
POINT = [*CPU, *"-n 4 -c 3 -H 16 -W 16 -k 16 -y 16 -x 16 -u 16 -v 16 -i 2 --warmup 0".split()]
SRC = Path(__file__).resolve().parents[2] / "src"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# ---- gemmconv conv ------------------------------------------------------------------


def test_conv_reports_every_direction(capsys):
    code, out, err = run(capsys, "conv", *POINT)
    assert code == 0, err
    for title in ("Forward:", "Backward-data:", "Backward-weights:"):
        assert title in out
    assert out.count("Verifies OK (rms=") == 3
    assert out.count("TFLOP/s") == 3 and out.count("GB/s") == 3
    assert out.count("call  speed-up ") == 3 and out.count("vendor ") >= 3
    expected = dispatch.decide(cli.problem_from_args(_parsed(POINT), torch.device("cpu")))
    assert expected.solver != "vendor" and f"Forward: solver {expected.solver} (" in out
    # The last line sums the run up: each direction's speed-up as printed above it.
    lines = out.splitlines()
    speedups = [line.split("speed-up ")[1] for line in lines if "call  speed-up " in line]
    assert out.splitlines()[-1] == (
        f"summary: speed-up over the vendor: forward {speedups[0]}, backward-data "
        f"{speedups[1]}, backward-weights {speedups[2]}; verified"
    )


@pytest.mark.parametrize(
    ("flags", "last_line"),
    [
        ("-t 0 -F 3", "summary: not timed; verified"),
        ("-V 0 -F 1 -S vendor", "summary: speed-up over the vendor: forward 1.00x (the vendor ran)"
         "; not verified"),
    ],
)  # fmt: skip
def test_the_summary_line_says_what_was_not_done(capsys, flags, last_line):
    code, out, err = run(capsys, "conv", *PATCH, *flags.split())
    assert code == 0, err
    assert out.splitlines()[-1] == last_line


def _parsed(argv):
    return cli.build_parser().parse_args(["conv", *argv])


def test_conv_json_is_complete_and_consistent(capsys):
    data = run_json(capsys, "conv", *PATCH)
    assert data["ok"] is True and data["dtype"] == "fp32" and data["layout"] == "NCHW"
    assert [d["direction"] for d in data["directions"]] == [
        "forward",
        "backward_data",
        "backward_weights",
    ]
    for d in data["directions"]:
        assert d["verified"] and d["ok"] and d["rms"] <= d["tol"]
        assert d["time_ms"] > 0 and d["vendor_ms"] > 0
        assert d["speedup"] == pytest.approx(d["vendor_ms"] / d["time_ms"])
        assert d["tflops"] > 0 and d["gbs"] > 0
        # On the CPU a call's time and its device time are one measurement.
        assert (d["device_ms"], d["vendor_device_ms"]) == (d["time_ms"], d["vendor_ms"])
        assert d["reps"] == 2


@pytest.mark.parametrize(
    ("bits", "expected"),
    [("1", ["forward"]), ("6", ["backward_data", "backward_weights"]), ("4", ["backward_weights"])],
)
def test_direction_bits_select_directions(capsys, bits, expected):
    data = run_json(capsys, "conv", *PATCH, "-F", bits)
    assert [d["direction"] for d in data["directions"]] == expected


def test_time_and_verify_can_be_turned_off(capsys):
    data = run_json(capsys, "conv", *PATCH, "-F", "1", "-t", "0", "-V", "0")
    d = data["directions"][0]
    assert d["time_ms"] is None and d["vendor_ms"] is None and not d["verified"]


@pytest.mark.parametrize(
    ("flags", "layout", "key_part"),
    [
        ("--spatial-dim 1 -W 12 -x 4 -v 4", "NCW", "1d-"),
        ("--layout NWC -W 12 -x 4 -v 4", "NWC", "1d-"),
        ("--layout NHWC -H 8 -W 8 -y 4 -x 4 -u 4 -v 4", "NHWC", "2d-"),
        (
            "--layout NDHWC --in-d 4 --fil-d 2 --stride-d 2 -H 8 -W 8 -y 4 -x 4 -u 4 -v 4",
            "NDHWC",
            "3d-",
        ),
        ("--spatial-dim 3 --in-d 2 --fil-d 1 -H 6 -W 6 -y 1 -x 1", "NCDHW", "3d-"),
    ],
)
def test_one_two_and_three_dimensional_problems(capsys, flags, layout, key_part):
    data = run_json(
        capsys, "conv", *CPU, "-n", "2", "-c", "4", "-k", "8", "-i", "1", *flags.split()
    )
    assert data["layout"] == layout and data["ok"]
    assert all(d["problem"].startswith(key_part) for d in data["directions"])


def test_bias_and_dtype_flags(capsys):
    data = run_json(capsys, "conv", *PATCH, "-F", "1", "--bias", "--dtype", "bf16")
    assert data["dtype"] == "bf16" and data["problem"].endswith("bf16, bias")
    assert data["directions"][0]["problem"].endswith("-b1") and data["ok"]
    data = run_json(capsys, "conv", *PATCH, "-F", "1", "-b", "1")
    assert data["directions"][0]["problem"].endswith("-b1")


@pytest.mark.parametrize("search", ["0", "1"])
def test_channels_last_with_bias_in_every_direction(capsys, search):
    """The driver's random operands: the bias is a plain vector whatever the layout."""
    flags = "-n 2 -c 3 -H 8 -W 8 -k 4 -y 2 -x 2 -u 2 -v 2 -i 1 --warmup 0 --layout NHWC --bias"
    data = run_json(capsys, "conv", *CPU, *flags.split(), "-s", search)
    assert data["ok"] and len(data["directions"]) == 3
    assert data["directions"][0]["problem"].endswith("-forward-b1")
    assert {d["source"] for d in data["directions"]} == {"find" if search == "1" else "estimate"}


def test_dtype_auto_is_fp32_on_the_cpu(capsys):
    assert run_json(capsys, "conv", *PATCH, "-F", "1")["dtype"] == "fp32"
    # The default of conv and demo alike, so the headline case runs fp32 on the CPU.
    for command in ("conv", "demo"):
        assert cli.build_parser().parse_args([command]).dtype == "auto"


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, "bf16"), (False, "fp16")])
def test_dtype_auto_on_a_gpu_is_bf16_only_where_native(monkeypatch, native_bf16, expected):
    import contextlib

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: asked.append(including_emulation) or native_bf16,
    )
    args = cli.build_parser().parse_args(["conv", *PATCH])
    problem = cli.problem_from_args(args, torch.device("cuda"))
    assert problem.dtype == cli._DTYPES[expected] and asked == [False]


def _wrong_result(self, p, t, out):
    ones = torch.ones(p.output_shape, dtype=p.dtype)
    return ones if out is None else out.copy_(ones)


def _leaves_output_unwritten(self, p, t, out):
    return torch.empty(p.output_shape, dtype=p.dtype) if out is None else out


@pytest.mark.parametrize("broken", [_wrong_result, _leaves_output_unwritten])
def test_failed_verification_prints_failed_and_exits_1(capsys, monkeypatch, broken):
    monkeypatch.setattr(Im2colSolver, "forward", broken)
    code, out, err = run(capsys, "conv", *PATCH, "-F", "1", "-S", "im2col", "-N", "1")
    assert code == 1
    assert "FAILED (rms=" in out and "Verifies OK" not in out
    last = out.splitlines()[-1]
    assert last.startswith("summary: speed-up over the vendor: forward ")
    assert last.endswith("; FAILED (forward)")


# ---- forced and disabled solvers, modes ------------------------------------------------


def test_forced_solver_flag(capsys):
    data = run_json(capsys, "conv", *PATCH, "-S", "im2col")
    assert {d["solver"] for d in data["directions"]} == {"im2col"}
    assert {d["source"] for d in data["directions"]} == {"forced"}


def test_forced_solver_environment(capsys, monkeypatch):
    monkeypatch.setenv("GEMMCONV_SOLVER", "vendor")
    data = run_json(capsys, "conv", *PATCH, "-F", "1")
    d = data["directions"][0]
    assert d["solver"] == "vendor" and d["speedup"] == pytest.approx(1.0)


def test_disabled_solvers_are_not_used(capsys, monkeypatch):
    monkeypatch.setenv("GEMMCONV_DISABLE", "patch,im2col")
    data = run_json(capsys, "conv", *PATCH)
    assert {d["solver"] for d in data["directions"]} == {"vendor"}


def test_find_flag_benchmarks_and_stores(capsys):
    data = run_json(capsys, "conv", *PATCH, "-s", "1")
    assert {d["source"] for d in data["directions"]} == {"find"}
    stored = {r.problem: r.solver for r in finddb.get_db().records()}
    assert stored == {d["problem"]: d["solver"] for d in data["directions"]}


@pytest.mark.parametrize(
    ("mode", "stored", "expected_source"),
    [
        ("immediate", True, "estimate"),
        ("database", True, "database"),
        ("database", False, "estimate"),
        ("hybrid", True, "database"),
        ("hybrid", False, "find"),
        ("find", True, "find"),
    ],
)
def test_every_mode_through_the_environment(capsys, monkeypatch, mode, stored, expected_source):
    problem = cli.problem_from_args(_parsed(PATCH), torch.device("cpu"))
    if stored:
        identity = finddb.identity_for("cpu")
        finddb.get_db().store(finddb.Record(problem.key(), identity, "vendor", {}, 1.0, 0))
    monkeypatch.setenv("GEMMCONV_FIND_MODE", mode)
    d = run_json(capsys, "conv", *PATCH, "-F", "1")["directions"][0]
    assert d["source"] == expected_source
    if expected_source == "database":
        assert d["solver"] == "vendor"


# ---- bad flags and inconsistent problems ---------------------------------------------------


_INT64_RANGE = "expected an integer from -9223372036854775808 to 9223372036854775807"
# Integers that fit no 64-bit integer (torch's sizes, strides and seeds), and problems
# whose tensors torch cannot size: a traceback (or a failure deep in torch) before.
_HUGE, _2_63 = "9" * 23, str(2**63)
_TOO_LARGE = [
    (f"conv -n {_HUGE}", "conv", f"argument -n/--batch: {_HUGE}: {_INT64_RANGE}"),
    (f"conv -u {_2_63}", "conv", f"argument -u/--stride-h: {_2_63}: {_INT64_RANGE}"),
    (f"conv -p -{2**63 + 1}", "conv", f"argument -p/--pad-h: -{2**63 + 1}: {_INT64_RANGE}"),
    (f"conv --seed {2**64}", "conv", f"argument --seed: {2**64}: {_INT64_RANGE}"),
    ("conv -i " + "9" * 5000, "conv", "-i/--iterations: 99999999999999999999... (5000 characters)"),
    (f"conv --warmup -{2**63 + 1}", "conv", f"argument --warmup: -{2**63 + 1}"),
    (f"conv -t {_2_63}", "conv", f"argument -t/--time: {_2_63}"),
    (f"conv -F {_2_63}", "conv", f"argument -F/--forw: {_2_63}"),
    (f"conv -p {2**62}", "conv", f"the padded input H=32+2*{2**62}"),
    (f"conv -n {2**62} --device cpu", "conv", f"the input tensor {2**62}x3x32x32 (fp32, from -n"),
    (f"conv -H {2**63 - 1}", "conv", f"the input tensor 100x3x{2**63 - 1}x32"),
    (f"conv -k {2**63 - 1}", "conv", f"the weight tensor {2**63 - 1}x3x3x3"),
    (f"conv -c 1 -H 1 -W 1 -y 1 -x 1 -n {2**60} -k 8", "conv", f"the output tensor {2**60}x8x1x1"),
    (f"demo -n {_HUGE}", "demo", f"argument -n/--batch: {_HUGE}: {_INT64_RANGE}"),
    (f"solvers --spatial-dim 3 --in-d {_2_63}", "solvers", "argument --in-d"),
    (f"solvers -g {_2_63}", "solvers", "argument -g/--groups"),
    # Each with a value or flag refused before anything runs, where it was accepted.
    (f"bench --reps -{2**63 + 1}", "bench", f"argument --reps: -{2**63 + 1}: {_INT64_RANGE}"),
    (f"bench --seed {2**64} --reps 0", "bench", f"argument --seed: {2**64}"),
    (f"bench --api --reps {_2_63} --layouts x", "bench --api", f"argument --reps: {_2_63}"),
    (f"bench --models --steps -{2**63 + 1}", "bench --models", "argument --steps"),
]


@pytest.mark.parametrize(
    ("argv", "prog", "message"),
    [
        ("conv -H 4 -W 4 -y 5 -x 5", "conv", "filter H=5 (-y/--fil-h, dilation 1)"),
        ("conv -c 3 -g 2", "conv", "-c/--in-channels 3 is not divisible by -g/--groups 2"),
        ("conv -k 30 -c 4 -g 4", "conv", "-k/--out-channels 30 is not divisible"),
        ("conv -S winograd", "conv", "-S/--solver winograd: unknown solver id"),
        ("conv -n 2 -S pointwise", "conv", "-S/--solver pointwise: does not apply"),
        ("conv --bogus", "conv", "unrecognized arguments: --bogus"),
        ("conv -n x", "conv", "invalid int value: 'x'"),
        ("conv -n 0", "conv", "-n/--batch 0: expected a value >= 1"),
        ("conv -u 0", "conv", "-u/--stride-h 0: expected a value >= 1"),
        ("conv --spatial-dim 3 --stride-d 0", "conv", "--stride-d 0: expected a value >= 1"),
        ("conv -p -1", "conv", "-p/--pad-h -1: expected a value >= 0"),
        ("conv -j 0", "conv", "-j/--dil-w 0"),
        ("conv -F 8", "conv", "-F/--forw 8"),
        ("conv -t 2", "conv", "argument -t/--time"),
        ("conv -i 0", "conv", "-i/--iterations 0"),
        ("conv --warmup -1", "conv", "--warmup -1: expected a value >= 0"),
        ("conv --dtype fp64", "conv", "argument --dtype"),
        ("conv --layout NCDHW --spatial-dim 1", "conv", "--layout NCDHW is 3-D"),
        ("conv --layout CHWN", "conv", "argument --layout"),
        ("demo -u 0", "demo", "-u/--stride-h 0"),
        ("solvers -y 40", "solvers", "filter H=40"),
        ("tune", "tune", "required: file"),
        ("tune /nonexistent/problems.txt", "tune", "cannot read '/nonexistent/problems.txt'"),
        ("db import", "db", "import: expected a FILE argument"),
        ("db drop", "db", "argument action"),
        ("bench --layouts nhwc", "bench", "--layouts nhwc: unknown nhwc"),
        ("bench --cases nope", "bench", "--cases nope: unknown nope"),
        ("bench --reps 0", "bench", "--reps 0: expected a value >= 1"),
        ("bench --warmup -1", "bench", "--warmup -1: expected a value >= 0"),
        ("bench --device tpu", "bench", "--device tpu: expected cpu or cuda"),
        ("bench --bogus", "bench", "unrecognized arguments: --bogus"),
        (
            "bench --device cpu --cases vit_b16 --dtypes fp32",
            "bench",
            "no rows to run: vit_b16 has no fp32 rows (its dtypes: bf16)",
        ),
        ("nothing", "", "invalid choice: 'nothing'"),
        ("--json", "", "required: COMMAND"),
        *[(argv, prog, message) for argv, prog, message in _TOO_LARGE],
    ],
)
def test_bad_flags_give_one_line_and_exit_2(capsys, argv, prog, message):
    """One rule in every subcommand, bench included: one line on stderr that starts
    with the command's name, and exit status 2."""
    code, out, err = run(capsys, *argv.split())
    assert code == 2
    lines = err.strip().splitlines()
    command = f"gemmconv {prog}".strip()
    assert len(lines) == 1 and lines[0].startswith(f"{command}: error: "), err
    assert message in lines[0]


def test_a_forced_solver_that_does_not_apply_blames_the_flag(capsys, monkeypatch):
    code, _, err = run(capsys, "conv", *CPU, "-n", "2", "-S", "pointwise")
    assert code == 2 and "-S/--solver" in err and "GEMMCONV_SOLVER" not in err
    assert "kernel (3, 3) is not 1x1" in err
    monkeypatch.setenv("GEMMCONV_SOLVER", "pointwise")
    code, _, err = run(capsys, "conv", *CPU, "-n", "2")
    assert code == 2 and "GEMMCONV_SOLVER" in err


def test_bare_gemmconv_prints_its_help_and_exits_0(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: gemmconv")
    for command in ("conv", "demo", "solvers", "tune", "db", "bench"):
        assert f"\n    {command} " in out
    assert "--version" in out


@pytest.mark.parametrize("argv", [["--version"], ["-h"]])
def test_version_and_help_exit_0(capsys, argv):
    from gemmconv import __version__

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    if argv == ["--version"]:
        assert out == f"gemmconv {__version__}\n"
    else:
        assert out.startswith("usage: gemmconv")


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        ("conv", ["-n BATCH, --batch BATCH", "(default: 100)", "(default: 32)", "(default: 10)"]),
        (
            "demo",
            [
                "(default: 9500)",
                "(default: 1280)",
                "(default: 14)",
                "(default: 100)",
                f"N={cli.DEMO_CPU_BATCH} and {cli.DEMO_CPU_ITERATIONS} repetitions",
            ],
        ),  # fmt: skip
        ("tune", ["--no-progress"]),
        ("db", ["--yes", "clear without asking"]),
        (
            "bench",
            [
                "(default: gemmconv-bench)",
                "(default: cf,cl)",
                "bench/results",
                "--api",
                "gemmconv bench --api --help",
                "--models",
                "gemmconv bench --models --help",
                "--check",
                "exit status 1 when a target is not met",
            ],
        ),  # fmt: skip
    ],
)
def test_help_shows_the_defaults(capsys, argv, shown):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv.split(), "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in shown:
        assert " ".join(text.split()) in out, text
    assert "(default: None)" not in out and "(default: )" not in out


def test_bad_environment_variable_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("GEMMCONV_DISABLE", "fft")
    code, _, err = run(capsys, "conv", *PATCH)
    assert code == 2 and "GEMMCONV_DISABLE='fft'" in err


def test_no_cuda_device_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, _, err = run(capsys, "conv", *PATCH, "--device", "cuda")
    assert code == 2 and "no CUDA device" in err


def test_python_dash_m_gives_no_traceback():
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "gemmconv", "conv", "-H", "4", "-y", "9"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "filter H=9" in result.stderr


# ---- gemmconv solvers ---------------------------------------------------------------------


def test_solvers_table_lists_every_solver_with_its_verdict(capsys):
    from gemmconv.solvers import solver_ids

    code, out, err = run(capsys, "solvers", *PATCH[:-4], "-F", "1")
    assert code == 0, err
    for sid in solver_ids():
        assert f" {sid} " in out
    assert "kernel (2, 2) is not 1x1" in out and "yes *" in out
    data = run_json(capsys, "solvers", *PATCH[:-4])
    assert len(data["solvers"]) == 3 * len(solver_ids())
    chosen = [r for r in data["solvers"] if r["immediate_choice"]]
    assert len(chosen) == 3 and all(r["applicable"] for r in chosen)
    for r in data["solvers"]:
        assert r["applicable"] == (not r["why_not"])
        assert (r["estimate_ms"] is None) == (not r["applicable"])


# ---- gemmconv db ----------------------------------------------------------------------------


def test_db_show_export_import_clear(capsys, tmp_path):
    run_json(capsys, "conv", *PATCH, "-s", "1", "-t", "0", "-V", "0")
    code, out, _ = run(capsys, "db", "show")
    assert code == 0 and "(3 results)" in out and "-forward-b0  ->  " in out
    other = finddb.Identity("NVIDIA H200", "9.0", "2.11.0", "0.1.0")
    finddb.get_db().store(finddb.Record("2d-elsewhere", other, "vendor", {}, 1.0, 0))
    shown = run_json(capsys, "db", "show")
    assert sorted(r["current"] for r in shown["records"]) == [False, True, True, True]
    dump = tmp_path / "dump.json"
    assert run(capsys, "db", "export", str(dump))[0] == 0
    code, out, _ = run(capsys, "db", "clear", "--yes")
    assert code == 0 and "cleared 4 results" in out
    assert finddb.get_db().records() == []
    code, out, _ = run(capsys, "db", "import", str(dump))
    assert code == 0 and "imported 4 results" in out
    assert len(finddb.get_db().records()) == 4


class _Terminal(io.StringIO):
    """Typed answers on a standard input that is a terminal."""

    def isatty(self) -> bool:
        return True


def _store_one_result() -> None:
    identity = finddb.identity_for("cpu")
    finddb.get_db().store(finddb.Record("2d-stored", identity, "vendor", {}, 1.0, 0))


def test_db_clear_without_a_terminal_refuses_unless_told_yes(capsys, monkeypatch):
    _store_one_result()
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a terminal: never read
    code, out, err = run(capsys, "db", "clear")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gemmconv db: error: ")
    assert "--yes" in lines[0]
    assert len(finddb.get_db().records()) == 1


@pytest.mark.parametrize(("answer", "cleared"), [("y\n", True), ("yes\n", True), ("n\n", False),
                                                 ("\n", False)])  # fmt: skip
def test_db_clear_asks_on_a_terminal(capsys, monkeypatch, answer, cleared):
    _store_one_result()
    monkeypatch.setattr(sys, "stdin", _Terminal(answer))
    code, out, _ = run(capsys, "db", "clear")
    assert "delete every stored result in " in out and "[y/N]" in out
    assert code == (0 if cleared else 1)
    assert ("cleared 1 results" in out) == cleared
    assert len(finddb.get_db().records()) == (0 if cleared else 1)


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gemmconv") and ": error: " in lines[0], err
    return lines[0]


def test_db_show_survives_rows_that_do_not_parse(capsys):
    identity = finddb.identity_for("cpu")
    finddb.get_db().store(finddb.Record("2d-good", identity, "patch", {}, 0.5, 0))
    conn = sqlite3.connect(finddb.default_path())
    for problem, config, ms in (("2d-bad-time", "{}", "fast"), ("2d-bad-config", "{no", 1.0)):
        conn.execute(
            "INSERT INTO find VALUES (?,?,?,?,?,?,?,?,?,?)",
            (problem, *identity.values(), "patch", config, ms, 0, 0.0),
        )
    conn.commit()
    conn.close()
    code, out, err = run(capsys, "db", "show")
    assert code == 0, err
    flagged = [line for line in out.splitlines() if line.startswith("! ")]
    assert len(flagged) == 2 and "time_ms='fast'" in out and "not JSON" in out, out
    assert "2d-good  ->  patch" in out and "!: does not parse" in out
    shown = run_json(capsys, "db", "show")["records"]
    assert sorted(bool(r.get("error")) for r in shown) == [False, True, True]


def test_db_import_of_a_bad_record_fails_and_leaves_the_database_as_it_was(capsys, tmp_path):
    identity = finddb.identity_for("cpu")
    good = [finddb.Record(f"2d-{i}", identity, "patch", {}, 0.5, 0) for i in range(50)]
    finddb.get_db().store_many(good)
    records = [r.as_json() for r in good[:3]]
    records[1]["time_ms"] = float("nan")
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"records": records}))
    code, out, err = run(capsys, "db", "import", str(dump))
    assert code != 0 and "imported" not in out
    line = _one_line_error(err)
    assert "record 1 (problem '2d-1')" in line and "time_ms=nan" in line, line
    assert len(finddb.FindDb(finddb.default_path()).records()) == 50
    assert not list(tmp_path.glob("find.sqlite.corrupt-*"))


def _insert_not_utf8(problem: str, column: str) -> None:
    """A find row whose ``column`` holds TEXT that is not UTF-8 (another tool's bytes)."""
    identity = finddb.identity_for("cpu")
    values = {
        "problem": problem, **dict(zip(("device", "capability", "torch_version",
                                        "gemmconv_version"), identity.values())),
        "solver": "patch", "config": "{}", "time_ms": 0.5, "workspace_bytes": 0, "created": 0.0,
    }  # fmt: skip
    values[column] = b"\xff not UTF-8"
    marks = ", ".join("CAST(? AS TEXT)" if name == column else "?" for name in values)
    conn = sqlite3.connect(finddb.default_path())
    conn.execute(f"INSERT INTO find ({', '.join(values)}) VALUES ({marks})", tuple(values.values()))
    conn.commit()
    conn.close()


def test_db_show_and_export_skip_rows_whose_text_is_not_utf8(capsys, tmp_path):
    identity = finddb.identity_for("cpu")
    finddb.get_db().store(finddb.Record("2d-good", identity, "patch", {}, 0.5, 0))
    columns = ("problem", "device", "solver", "config", "time_ms", "workspace_bytes")
    for column in columns:
        _insert_not_utf8(f"2d-bad-{column}", column)
    code, out, err = run(capsys, "db", "show")
    assert code == 0, err
    flagged = [line for line in out.splitlines() if line.startswith("! ")]
    assert len(flagged) == len(columns) and "(7 results)" in out, out
    assert "2d-good  ->  patch" in out and "!: does not parse" in out
    shown = run_json(capsys, "db", "show")["records"]
    assert sum(bool(r.get("error")) for r in shown) == len(columns)
    dump = tmp_path / "dump.json"
    code, out, err = run(capsys, "db", "export", str(dump))
    assert code == 0 and "exported 1 results" in out, err
    assert [r["problem"] for r in json.loads(dump.read_text())["records"]] == ["2d-good"]
    skipped = err.strip().splitlines()  # one line for each row left out
    assert len(skipped) == len(columns), err
    assert all(line.startswith("gemmconv db: warning: ") for line in skipped), err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"time_ms": int("9" * 400)}, "time_ms=<an integer of 400 digits>: expected a finite"),
        ({"workspace_bytes": 2**64}, f"workspace_bytes={2**64}: expected an integer from 0"),
    ],
)
def test_db_import_of_a_number_out_of_range_is_one_line_and_writes_nothing(
    capsys, tmp_path, change, message
):
    identity = finddb.identity_for("cpu")
    good = [finddb.Record(f"2d-{i}", identity, "patch", {}, 0.5, 0) for i in range(3)]
    finddb.get_db().store_many(good[:1])
    records = [r.as_json() for r in good]
    records[2].update(change)
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"records": records}))
    code, out, err = run(capsys, "db", "import", str(dump))
    assert code == 2 and "imported" not in out
    line = _one_line_error(err)
    assert "record 2 (problem '2d-2')" in line and message in line and "nothing imported" in line
    assert [r.problem for r in finddb.FindDb(finddb.default_path()).records()] == ["2d-0"]


def test_db_import_reports_what_it_stored_when_records_share_a_key(capsys, tmp_path):
    identity = finddb.identity_for("cpu")
    first = finddb.Record("2d-a", identity, "patch", {}, 0.5, 0).as_json()
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"records": [first, {**first, "solver": "vendor"}]}))
    code, out, err = run(capsys, "db", "import", str(dump))
    assert code == 0, err
    assert "imported 1 results" in out and "1 of the file's 2 records replaced" in out, out
    assert [r.solver for r in finddb.get_db().records()] == ["vendor"]


@pytest.mark.parametrize("kind", ["same", "relative", "symlink", "hard_link"])
def test_db_export_into_the_live_database_is_refused(capsys, tmp_path, monkeypatch, kind):
    _store_one_result()
    path = finddb.default_path()
    finddb.reset_db()  # closed: the file holds every row, and no -wal
    target = {"same": str(path), "relative": path.name}.get(kind, str(tmp_path / "other"))
    if kind == "relative":
        monkeypatch.chdir(path.parent)
    elif kind == "symlink":
        Path(target).symlink_to(path)
    elif kind == "hard_link":
        Path(target).hardlink_to(path)
    before = path.read_bytes()
    code, out, err = run(capsys, "db", "export", target)
    assert code == 2 and "exported" not in out
    assert "is the find database's own file" in _one_line_error(err)
    assert path.read_bytes() == before
    assert len(finddb.FindDb(path).records()) == 1


@pytest.mark.parametrize("action", ["show", "clear", "export", "import"])
def test_db_commands_refuse_another_applications_file(capsys, tmp_path, action):
    path = finddb.default_path()
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"records": []}))
    extra = {"export": [str(dump)], "import": [str(dump)], "clear": ["--yes"]}.get(action, [])
    code, _, err = run(capsys, "db", action, *extra)
    assert code == 1
    assert "is not a gemmconv find database" in _one_line_error(err)
    assert path.read_bytes() == before


def test_db_import_into_an_unusable_location_fails(capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("GEMMCONV_DB", str(blocker / "find.sqlite"))
    identity = finddb.identity_for("cpu")
    dump = tmp_path / "dump.json"
    records = [finddb.Record(f"2d-{i}", identity, "patch", {}, 0.5, 0) for i in range(3)]
    dump.write_text(json.dumps({"records": [r.as_json() for r in records]}))
    code, out, err = run(capsys, "db", "import", str(dump))
    assert code == 1 and "imported" not in out
    assert "cannot open" in _one_line_error(err)


# ---- gemmconv tune ----------------------------------------------------------------------------


def test_tune_finds_every_problem_of_a_file(capsys, tmp_path):
    problems = tmp_path / "problems.txt"
    problems.write_text(
        "# patch embedding, forward only\n"
        + " ".join(PATCH[:-4])
        + " -F 1\n\n-n 2 -c 8 -H 6 -W 6 -k 8 -y 1 -x 1 --layout NHWC --device cpu  # pointwise\n"
    )
    code, out, err = run(capsys, "tune", str(problems), "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    assert len(results) == 4
    for r in results:
        assert is_finds_pick(r["solver"], r["times_ms"], r["immediate"])
        assert r["time_ms"] == r["times_ms"][r["solver"]]
        # The call time is the public call's (find times candidates in the call users
        # make), the device time the bare run's.
        assert set(r["device_times_ms"]) == set(r["times_ms"])
        assert all(t > 0 for t in r["device_times_ms"].values())
    assert [r["problem"].rsplit("-", 2)[-2] for r in results] == [
        "forward",
        "forward",
        "backward_data",
        "backward_weights",
    ]
    assert err == ""  # stderr is not a terminal here: no progress bar
    assert len(finddb.get_db().records()) == 4


def test_tune_names_the_bad_line(capsys, tmp_path):
    problems = tmp_path / "problems.txt"
    problems.write_text(" ".join(PATCH[:-4]) + "\n-n 2 -y 99\n")
    code, _, err = run(capsys, "tune", str(problems))
    assert code == 2 and "problems.txt:2: filter H=99" in err
    problems.write_text("-n 99999999999999999999999\n")
    code, _, err = run(capsys, "tune", str(problems))
    assert code == 2 and "problems.txt:1: argument -n/--batch: 9999" in _one_line_error(err)


# ---- gemmconv demo --------------------------------------------------------------------------


def test_demo_presets_the_headline_case(capsys):
    code, out, err = run(capsys, "demo", *CPU, "-n", "16", "-i", "1", "--warmup", "0")
    assert code == 0, err
    assert "N=16 C=3 14x14 -> K=1280, filter 14x14, stride 14x14" in out
    assert out.count("Verifies OK") == 3
    assert "Forward: solver point_output" in out
    last = out.splitlines()[-1]
    assert last.startswith("summary: speed-up over the vendor: forward ")
    assert "backward-data " in last and "backward-weights " in last
    assert last.endswith("; verified")


def test_demo_on_the_cpu_uses_a_short_run(monkeypatch):
    seen = {}

    def capture(args):
        seen.update(batch=args.batch, iterations=args.iterations, notes=args.notes)
        return 0

    monkeypatch.setattr(cli, "cmd_conv", capture)
    assert cli.main(["demo", "--device", "cpu"]) == 0
    assert seen["batch"] == cli.DEMO_CPU_BATCH and seen["iterations"] == cli.DEMO_CPU_ITERATIONS
    assert "-n 9500" in seen["notes"][0]
    assert cli.main(["demo", "--device", "cpu", "-n", "9500", "-i", "7"]) == 0
    assert seen["batch"] == 9500 and seen["iterations"] == 7 and seen["notes"] == []


# ---- progress and long runs -------------------------------------------------------------


@pytest.fixture
def bars(monkeypatch) -> list[RecordingBar]:
    return RecordingBar.patch(monkeypatch, cli)


# POINT times 2 repetitions with no warm-up. Per direction: the solver's checked call
# and its timed calls, the vendor's in verification and timed, the float64 reference.
@pytest.mark.parametrize(
    ("flags", "total"),
    [
        ("", 3 * (1 + 2 + 1 + 2 + 1)),
        ("-S vendor", 3 * (1 + 2 + 1 + 1)),
        ("-t 0", 3 * (1 + 1 + 1)),
        ("-V 0 -F 1", 1 + 2 + 2),
    ],
)
def test_the_conv_bar_counts_every_convolution_of_the_run(capsys, bars, flags, total):
    code, _, err = run(capsys, "conv", *POINT, *flags.split())
    assert code == 0, err
    assert len(bars) == 1 and bars[0].desc == "conv"
    assert bars[0].total == total and bars[0].n == total


def test_progress_bars_only_when_stderr_is_a_terminal(capsys, monkeypatch, tmp_path):
    problems = tmp_path / "problems.txt"
    problems.write_text(" ".join(POINT[:-4]) + " -F 1\n")
    for argv in (["conv", *POINT, "-F", "1"], ["tune", str(problems)]):
        code, _, err = run(capsys, *argv)
        assert code == 0 and err == "", err
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    code, out, err = run(capsys, "conv", *POINT, "-F", "1")
    assert code == 0 and "conv:" in err and "/7 " in err and "Verifies OK" in out
    code, _, err = run(capsys, "tune", str(problems))
    assert code == 0 and "find:" in err and "/1 " in err
    code, _, err = run(capsys, "tune", str(problems), "--no-progress")
    assert code == 0 and err == ""


HEADLINE_BF16 = "-n 9500 -c 3 -H 14 -W 14 -k 1280 -y 14 -x 14 -u 14 -v 14 --dtype bf16".split()


def test_a_long_cpu_run_is_announced_before_it_starts(capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt  # stands for the first convolution of the run

    monkeypatch.setattr(cli, "run_direction", interrupted)
    code, out, err = run(capsys, "conv", *HEADLINE_BF16, "--device", "cpu")
    assert code == 130
    warning, interruption = err.strip().splitlines()
    assert warning.startswith("gemmconv conv: warning: this run may take up to ")
    assert "on the CPU" in warning and "--dtype fp32" in warning and "-i 1" in warning
    assert interruption == "gemmconv conv: interrupted"
    # The demo the README runs first is foreseen as short on the CPU: no warning.
    code, out, err = run(capsys, "demo", "--device", "cpu")
    assert code == 130 and err.strip() == "gemmconv demo: interrupted"


# One call of torch's backward-data of this problem takes 13-19 s on a 2-core CPU, so
# before Ctrl-C was heard outside the running call, the interrupt below waited that long.
LONG_CALL = (
    "-n 38000 -c 3 -H 14 -W 14 -k 1280 -y 14 -x 14 -u 14 -v 14 --dtype fp32 "
    "-F 2 -S vendor -V 0 -i 1000 --device cpu"
).split()


def test_ctrl_c_stops_a_long_cpu_run_at_once_with_one_line_and_status_130():
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "gemmconv", "conv", *LONG_CALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        header = child.stdout.readline()  # printed just before the first convolution
        assert header.startswith("gemmconv conv: N=38000"), header
        time.sleep(2.0)  # inside the first timed call by now
        assert child.poll() is None
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130, err
    assert waited < 3.0, f"Ctrl-C took {waited:.1f} s to act"
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "gemmconv conv: interrupted"


def test_a_command_run_interruptibly_returns_and_raises_as_it_would():
    from gemmconv.terminal.interrupt import run_interruptibly

    assert run_interruptibly(lambda: 7, "x: interrupted") == 7
    with pytest.raises(SystemExit) as exit_info:  # --help in a bench module, say
        run_interruptibly(lambda: sys.exit(0), "x: interrupted")
    assert exit_info.value.code == 0

    def broken():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_interruptibly(broken, "x: interrupted")


def test_long_run_estimates():
    from gemmconv.terminal.long_run import LONG_RUN_SECONDS, Calls, cpu_seconds, long_run_warning

    args = cli.build_parser().parse_args(["conv", *HEADLINE_BF16])
    problem = cli.problem_from_args(args, torch.device("cpu"))
    gflop = problem.flops() / 1e9
    assert cpu_seconds(problem, Calls(vendor=1)) == pytest.approx(gflop / 0.3)
    assert cpu_seconds(problem, Calls(gemm=2, reference=1)) == pytest.approx(
        2 * gflop / 10.0 + gflop / 5.0
    )
    on_gpu = cli.problem_from_args(args, torch.device("cuda"))
    assert cpu_seconds(on_gpu, Calls(vendor=100)) == 0.0
    assert long_run_warning(LONG_RUN_SECONDS, "x") is None
    assert "up to 3 min" in long_run_warning(180.0, "shorten it")
    assert "up to 2.5 h" in long_run_warning(9000.0, "shorten it")


# ---- gemmconv bench -------------------------------------------------------------------------


def test_bench_forwards_its_arguments(monkeypatch):
    received = []
    fake = types.ModuleType("gemmconv.bench.suite")
    fake.main = lambda argv: received.append(argv) or 0
    monkeypatch.setitem(sys.modules, "gemmconv.bench.suite", fake)
    assert cli.main(["bench", "--quick", "--cases", "point2d"]) == 0
    assert received == [["--quick", "--cases", "point2d"]]


def test_bench_without_the_suite_installed_exits_2(capsys, monkeypatch):
    import importlib

    real = importlib.import_module

    def missing(name, *args):
        if name == "gemmconv.bench.suite":
            raise ModuleNotFoundError("No module named 'gemmconv.bench.suite'", name=name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", missing)
    code, _, err = run(capsys, "bench", "--quick")
    assert code == 2 and "gemmconv.bench.suite" in err and "Traceback" not in err


# ---- on the GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_demo_on_the_gpu_is_fast_and_verified(capsys):
    data = run_json(capsys, "demo")
    assert data["ok"] and data["dtype"] == "bf16"
    for d in data["directions"]:
        assert d["verified"] and d["ok"]
        assert d["speedup"] > 1.0, d


# The benchmark suite (gemmconv.bench.suite.SUITE) as driver flag lines, both layouts, every
# direction.
SUITE_LINES = [
    "-n 9500 -c 3 -H 14 -W 14 -k 1280 -y 14 -x 14 -u 14 -v 14 --dtype bf16",
    "-n 9500 -c 3 --in-d 2 -H 14 -W 14 -k 1280 --fil-d 2 -y 14 -x 14 --stride-d 2 -u 14 -v 14"
    " --dtype bf16 --spatial-dim 3",
    "-n 8192 -c 3 --in-d 2 -H 14 -W 14 -k 1280 --fil-d 2 -y 14 -x 14 --stride-d 2 -u 14 -v 14"
    " --dtype bf16 --spatial-dim 3",
    "-n 8192 -c 3 --in-d 2 -H 16 -W 16 -k 1152 --fil-d 2 -y 16 -x 16 --stride-d 2 -u 16 -v 16"
    " --dtype bf16 --spatial-dim 3",
    "-n 1 -c 16 --in-d 21 -H 60 -W 104 -k 5120 --fil-d 1 -y 2 -x 2 --stride-d 1 -u 2 -v 2"
    " --dtype bf16 --spatial-dim 3",
    "-n 8 -c 16 -H 128 -W 128 -k 1536 -y 2 -x 2 -u 2 -v 2 --dtype bf16",
    "-n 256 -c 3 -H 224 -W 224 -k 768 -y 16 -x 16 -u 16 -v 16 --dtype bf16",
    "-n 128 -c 3 -H 336 -W 336 -k 1024 -y 14 -x 14 -u 14 -v 14 --dtype bf16",
    "-n 8 -c 3 -H 1024 -W 1024 -k 1280 -y 16 -x 16 -u 16 -v 16 --dtype bf16",
    "-n 16 -c 3 --in-d 16 -H 224 -W 224 -k 768 --fil-d 2 -y 16 -x 16 --stride-d 2 -u 16 -v 16"
    " --dtype bf16 --spatial-dim 3",
    "-n 256 -c 4 -H 32 -W 32 -k 1152 -y 2 -x 2 -u 2 -v 2 --dtype bf16",
    "-n 128 -c 192 -H 56 -W 56 -k 384 -y 2 -x 2 -u 2 -v 2 --dtype bf16",
    "-n 256 -c 256 -H 56 -W 56 -k 64 -y 1 -x 1 --dtype bf16",
    "-n 9500 -c 3 -H 14 -W 14 -k 1280 -y 14 -x 14 -u 14 -v 14 --dtype fp16",
    "-n 9500 -c 3 -H 14 -W 14 -k 1280 -y 14 -x 14 -u 14 -v 14 --dtype fp32",
]


def _suite_file(tmp_path) -> Path:
    lines = []
    for line in SUITE_LINES:
        dims = 3 if "--spatial-dim 3" in line else 2
        for layout in ("NCDHW", "NDHWC") if dims == 3 else ("NCHW", "NHWC"):
            lines.append(f"{line} --layout {layout} --device cuda")
    path = tmp_path / "suite.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.gpu
def test_gpu_tune_on_the_suite_reports_find_and_immediate(capsys, tmp_path):
    """`gemmconv tune` over every suite row: find's winner follows its rule (the fastest
    candidate it timed, or immediate's pick within 5% of it) and immediate's ratio is
    measured against it. How often they agree is a benchmark figure, not a pass mark
    (timings vary run to run): it is printed, and kept
    as JSON where GEMMCONV_AGREEMENT_OUT names a file
    (bench/results/h200_immediate_vs_find.json)."""
    import os

    data = run_json(capsys, "tune", str(_suite_file(tmp_path)), "--no-progress")
    results, summary = data["results"], data["summary"]
    assert len(results) == summary["problems"] == len(SUITE_LINES) * 2 * 3
    for r in results:
        assert is_finds_pick(r["solver"], r["times_ms"], r["immediate"])
        assert r["immediate"] in r["times_ms"], r
        assert r["immediate_ratio"] == pytest.approx(r["times_ms"][r["immediate"]] / r["time_ms"])
        assert r["agrees"] == (r["immediate"] == r["solver"])
    assert summary["agree"] == sum(r["agrees"] for r in results)
    out = os.environ.get("GEMMCONV_AGREEMENT_OUT")
    if out:
        Path(out).write_text(json.dumps(data, indent=1) + "\n")
    with capsys.disabled():
        print(f"\nimmediate vs find on the suite: {summary}")
        for r in results:
            if not r["agrees"]:
                print(
                    f"  {r['problem']}: find {r['solver']}, immediate {r['immediate']} "
                    f"({r['immediate_ratio']:.2f}x)"
                )
