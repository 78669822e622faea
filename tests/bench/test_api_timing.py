"""The public-call timing (gemmconv.bench.call_timing) and its table (gemmconv bench --api):
each timed call computes what its kind says (against float64), the timing loop
interleaves back-to-back blocks and measures known durations, the table's files and
ratios, and the command line."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from gemmconv.bench.call_timing import (
    CALL_KINDS,
    api_times,
    linear_applies,
    public_call_kernels,
    public_calls,
)
from gemmconv.bench.public_calls import API_CASES
from gemmconv.bench.public_calls import main as api_main
from gemmconv.cli import commands as cli
from gemmconv.core.memory_format import Layout
from gemmconv.core.problem import ConvProblem, Direction
from gemmconv.measuring.measure import operand_bytes, operand_sets
from gemmconv.measuring.verify import rms_range, tolerance

CPU = torch.device("cpu")
TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _problem(spatial, kernel, layout=Layout.CHANNELS_FIRST, bias=True, **kwargs):
    return ConvProblem.from_sizes(
        n=2, c=3, k=5, spatial=spatial, kernel=kernel, stride=kwargs.pop("stride", kernel),
        layout=layout, dtype=torch.float32, has_bias=bias, **kwargs,
    )  # fmt: skip


def _expected(p: ConvProblem, kind: str, t) -> tuple[torch.Tensor, ...]:
    """The float64 result of the call ``kind`` on the operands ``t``."""
    x = t.input.double().requires_grad_(kind in ("bwd_data", "fwd_bwd"))
    w = t.weight.double().requires_grad_(kind != "bwd_data")
    b = None if t.bias is None else t.bias.double().requires_grad_(kind in ("fwd_bwd", "fwd_wgrad"))
    y = TORCH_CONV[p.dims](x, w, b, p.stride, p.padding, p.dilation, p.groups)
    if kind == "fwd":
        return (y,)
    wrt = {"bwd_data": (x,), "bwd_weights": (w,), "fwd_bwd": (x, w, b), "fwd_wgrad": (w, b)}[kind]
    wrt = tuple(v for v in wrt if v is not None)
    return torch.autograd.grad(y, wrt, t.grad_output.double())


PROBLEMS = {
    "patch2d_cf": _problem((8, 12), (4, 4)),
    "patch2d_cl_remainder": _problem((9, 13), (4, 4), Layout.CHANNELS_LAST),
    "point3d_no_bias": _problem((2, 6, 6), (2, 6, 6), bias=False),
    "pointwise1d": _problem((7,), (1,)),
    "padded2d": _problem((8, 8), (3, 3), stride=(1, 1), padding=(1, 1)),  # no rewrite
}


@pytest.mark.parametrize("kind", CALL_KINDS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_every_timed_call_computes_its_kind(name, kind):
    p = PROBLEMS[name]
    (operands,) = operand_sets(p, CPU, seed=3, every_operand=True)
    assert operands.input.abs().min() > 0 and operands.grad_output.abs().min() > 0
    calls = public_calls(p, kind, [operands])
    assert set(calls) == ({"torch", "linear", "gemmconv"} if linear_applies(p)
                          else {"torch", "gemmconv"})  # fmt: skip
    expected = _expected(p, kind, operands)
    for implementation, (call,) in calls.items():
        result = call()
        result = (result,) if isinstance(result, torch.Tensor) else result
        assert len(result) == len(expected), implementation
        for got, want in zip(result, expected, strict=True):
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert rms_range(got, want) <= tolerance(torch.float32, "cpu"), (implementation, kind)
        if kind in ("bwd_data", "bwd_weights"):  # the graph is retained: a second call works
            call()


def test_forward_runs_without_a_graph():
    p = PROBLEMS["patch2d_cf"]
    calls = public_calls(p, "fwd", operand_sets(p, CPU, every_operand=True))
    for implementation, (call,) in calls.items():
        assert not call().requires_grad, implementation


def test_unknown_kind_is_refused_by_name():
    p = PROBLEMS["patch2d_cf"]
    with pytest.raises(ValueError, match=r"kind='bwd'.*fwd, bwd_data"):
        public_calls(p, "bwd", operand_sets(p, CPU, every_operand=True))


def test_api_times_gives_the_suite_columns():
    p = PROBLEMS["patch2d_cf"].with_direction(Direction.BACKWARD_WEIGHTS)
    columns = api_times(p, "cpu", reps=2)
    assert set(columns) == {"api_ms", "vendor_api_ms", "linear_api_ms"}
    assert all(v > 0 for v in columns.values())
    assert public_call_kernels(p, "cpu") is None  # counted on CUDA only (kernel_count)
    padded = api_times(PROBLEMS["padded2d"], "cpu", reps=1)
    assert padded["linear_api_ms"] is None and padded["api_ms"] > 0


# ---- the table -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_table(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    argv = ["--api", "--device", "cpu", "--quick", "--cases", "vit_b16_b8,point2d_950",
            "--reps", "2", "--out", str(out)]  # fmt: skip
    return api_main(argv), out


def test_quick_table_writes_every_row_with_same_run_ratios(quick_table):
    code, out = quick_table
    assert code == 0
    data = json.loads((out / "cpu.json").read_text())
    assert data["device"] == "cpu" and data["quick"] and data["torch"] == torch.__version__
    assert data["errors"] == []
    rows = data["rows"]
    # A quick run names each case by the tiny batch it runs (2 and 8), not 8 and 950.
    assert [(r["case"], r["kind"]) for r in rows] == [
        (case, kind)
        for case in ("tiny_vit_b16_b2", "tiny_point2d_8")
        for kind in ("fwd", "fwd_bwd", "bwd_weights")
    ]
    for r in rows:
        assert r["agrees"], r["rms_vs_torch"]
        assert r["speedup_vs_torch"] == pytest.approx(r["torch_ms"] / r["gemmconv_ms"])
        assert r["speedup_vs_linear"] == pytest.approx(r["linear_ms"] / r["gemmconv_ms"])
        assert r["find_ms"] > 0  # gemmconv's call in find mode, beside the default's
        # Batch invariance changes the forward only: its cost is a forward row's.
        if r["kind"] == "fwd":
            assert r["invariant_ms"] > 0
            assert r["invariance_cost"] == pytest.approx(r["invariant_ms"] / r["gemmconv_ms"])
        else:
            assert r["invariant_ms"] is None and r["invariance_cost"] is None
        # On the CPU torch's own convolution is as fast as a GEMM on a many-pixel patch
        # embed (device_rates.CPU), and far behind one where each sample is one patch.
        expected = ("vendor",) if r["case"] == "tiny_vit_b16_b2" else ("patch", "point_output")
        assert r["solvers"]["forward"] in expected, r["solvers"]
    text = (out / "cpu.md").read_text()
    assert (
        "QUICK" in text
        and "| ViT-B/16 patch embed, 2x3x32x32 -> 16, k=s=16 | cf | forward |" in text
    )
    assert "Target: every row >= 0.95 x torch" in text
    forward, backward = (f"| {_cost_of(rows, kind)} |" for kind in ("fwd", "fwd_bwd"))
    assert forward in text and backward == "| — |" and "| — |" in text


def _cost_of(rows: list[dict], kind: str) -> str:
    """The invariant column's text of the first row of ``kind``."""
    cost = next(r["invariance_cost"] for r in rows if r["kind"] == kind)
    return "—" if cost is None else f"{cost:.2f}x"


@pytest.mark.parametrize(("bound", "met"), [(float("inf"), False), (0.0, True)])
def test_the_table_ends_with_its_targets_and_check_fails_on_a_miss(
    monkeypatch, tmp_path, capsys, bound, met
):
    from gemmconv.bench import public_calls

    monkeypatch.setattr(public_calls, "NOT_SLOWER", bound)
    # The quick name is taken as well as the full one.
    argv = ["--device", "cpu", "--quick", "--cases", "tiny_point2d_8", "--kinds", "fwd",
            "--reps", "1", "--out", str(tmp_path)]  # fmt: skip
    assert api_main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert api_main([*argv, "--check"]) == (0 if met else 1)
    note = "(a quick run: tiny sizes, not a measurement)"
    if met:
        assert last == f"targets: all 1 met {note}"
    else:
        assert (
            last == f"targets: 1 of 1 NOT met {note}: tiny_point2d_8/cf/fwd under inf x "
            "torch or x linear"
        )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kinds", "fwd,backward"], "--kinds fwd,backward: expected a comma list of fwd"),
        (["--cases", "vit"], "--cases: cases=['vit']: unknown"),
        (["--reps", "0"], "--reps 0: expected a value >= 1"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_table_flags_are_one_usage_line_naming_the_flag(argv, message, tmp_path, capsys):
    assert api_main(["--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemmconv bench --api: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize(
    "flag, module",
    [("--api", "gemmconv.bench.public_calls"), ("--models", "gemmconv.bench.models")],
)
def test_bench_routes_api_and_models_to_their_modules(monkeypatch, flag, module):
    received = []
    fake = types.ModuleType(module)
    fake.main = lambda argv: received.append(argv) or 0
    monkeypatch.setitem(sys.modules, module, fake)
    assert cli.main(["bench", "--quick", flag]) == 0
    assert received == [["--quick", flag]]


@pytest.mark.gpu
def test_quick_table_on_cuda_every_kind_agrees(tmp_path):
    argv = ["--device", "cuda", "--quick", "--kinds", ",".join(CALL_KINDS), "--layouts",
            "cf,cl", "--reps", "3", "--out", str(tmp_path), "--name", "gpu"]  # fmt: skip
    assert api_main(argv) == 0
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert len(rows) == len(API_CASES) * len(CALL_KINDS) * 2
    assert all(r["agrees"] and r["gemmconv_ms"] > 0 and r["dtype"] == "bf16" for r in rows)


@pytest.mark.gpu
def test_api_times_on_cuda_rotates_operands_past_the_l2():
    p = ConvProblem.from_sizes(n=64, c=3, k=768, spatial=(224, 224), kernel=16, stride=16,
                               dtype=torch.bfloat16, device_type="cuda")  # fmt: skip
    sets = operand_sets(p, torch.device("cuda"), every_operand=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert len(sets) == 8 or sum(operand_bytes(s) for s in sets) >= 2 * l2
    columns = api_times(p, "cuda", reps=5)
    assert all(v is not None and v > 0 for v in columns.values())
