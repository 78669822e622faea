"""Property-based tests: random convolutions, eligible for a GEMM solver and not.

Every example is a ConvCase (tests/random_conv.py): 1-D/2-D/3-D, both layouts, random
stride, padding (integers, 'same', 'valid'), dilation and groups, fp32 and fp64,
non-contiguous views of the input, weight, bias and output gradient. Each is checked
against a float64 reference through the public functions (also in each selection
mode: immediate, database, find, hybrid), through every solver that accepts it, and
through the nn modules. Runs are deterministic (derandomize, no
example database), so CI runs the same few hundred examples every time; an example
that ever fails is kept in test_regressions.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

# CI installs hypothesis (the test extra); a machine without it skips this module by name.
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

import gemmconv
import gemmconv.nn
from gemmconv import Direction, Layout, get_solver, solver_ids
from gemmconv.core.problem import one_window_stride
from gemmconv.measuring import measure
from gemmconv.selection import dispatch, finddb

from random_conv import (
    CF,
    CL,
    DY_VIEWS,
    TORCH_CONV,
    W_VIEWS,
    X_VIEWS,
    ConvCase,
    assert_matches_reference,
    check_against_torch,
    check_every_solver,
)
from solver_cases import INTERPRETER_DTYPES, interpreted

# torch warns that 'same' padding with an even kernel copies the input; not under test.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")

# Small sizes so several hundred examples run in about a minute on two cores.
MAX_SPATIAL = {1: 12, 2: 8, 3: 5}
KINDS = ("patch", "point_output", "pointwise", "strided_pointwise", "near_miss", "general")
# The solver each eligible kind exists to exercise.
KIND_SOLVER = {
    "patch": "patch",
    "point_output": "point_output",
    "pointwise": "pointwise",
    "strided_pointwise": "strided_pointwise",
}


def _settings(examples: int):
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---- geometry per kind -----------------------------------------------------------


@st.composite
def _patch_dim(draw, cap: int):
    r = draw(st.integers(1, 3))
    o = draw(st.integers(1, cap // r))
    remainder = draw(st.integers(0, min(r - 1, cap - o * r)))
    return o * r + remainder, r, r, 0, 1


@st.composite
def _point_output_dim(draw, cap: int):
    r = draw(st.integers(1, min(4, cap)))
    s = draw(st.integers(r, min(2 * r - 1, cap)))
    return s, r, r, 0, 1


@st.composite
def _pointwise_dim(draw, cap: int, strided: bool):
    u = draw(st.integers(1, 3)) if strided else 1
    # A stride over one output pixel changes nothing and is stored as 1 (the problem's
    # one_window_stride): a strided dimension has at least two outputs.
    s = draw(st.integers(1 if u == 1 else u + 1, cap))
    return s, 1, u, 0, 1


@st.composite
def _general_dim(draw, cap: int):
    r = draw(st.integers(1, 3))
    d = draw(st.integers(1, 2))
    p = draw(st.integers(0, 2))
    u = draw(st.integers(1, 3))
    s = draw(st.integers(max(1, d * (r - 1) + 1 - 2 * p), cap))
    return s, r, u, p, d


def _columns(per_dim):
    """[(s, r, u, p, d), ...] per dimension -> (spatial, kernel, stride, padding, dilation)."""
    return tuple(tuple(values) for values in zip(*per_dim, strict=True))


@st.composite
def geometries(draw, kind: str, dims: int):
    """(spatial, kernel, stride, padding, dilation, groups) of one kind."""
    cap = MAX_SPATIAL[dims]
    groups = 1
    if kind == "patch":
        per_dim = [draw(_patch_dim(cap)) for _ in range(dims)]
    elif kind == "point_output":
        per_dim = [draw(_point_output_dim(cap)) for _ in range(dims)]
    elif kind in ("pointwise", "strided_pointwise"):
        strided = kind == "strided_pointwise"
        per_dim = [draw(_pointwise_dim(cap, strided)) for _ in range(dims)]
        if strided and all(u == 1 for _, _, u, _, _ in per_dim):
            s, r, _, p, d = per_dim[0]
            per_dim[0] = (max(s, 3), r, 2, p, d)
    elif kind == "near_miss":
        # An eligible geometry with one thing changed, so exactly one rule rejects it.
        base = draw(st.sampled_from(["patch", "pointwise"]))
        make = _patch_dim(cap) if base == "patch" else _pointwise_dim(cap, strided=False)
        per_dim = [list(draw(make)) for _ in range(dims)]
        i = draw(st.integers(0, dims - 1))
        change = draw(
            st.sampled_from(["padding", "dilation", "stride_up", "stride_down", "groups"])
        )
        s, r, u, p, d = per_dim[i]
        # A stride that changes nothing (one output pixel) is no near miss: the problem
        # stores it as the kernel's size (one_window_stride).
        changes_output = {v: one_window_stride((s,), (r,), (v,), (p,), (d,)) == (v,)
                          for v in (u + 1, u - 1)}  # fmt: skip
        if change == "padding":
            per_dim[i][3] = 1
        elif change == "dilation" and r > 1 and s >= 2 * (r - 1) + 1:
            per_dim[i][4] = 2
        elif change == "stride_up" and changes_output[u + 1]:
            per_dim[i][2] = u + 1
        elif change == "stride_down" and u > 1 and changes_output[u - 1]:
            per_dim[i][2] = u - 1
        else:
            groups = 2
    else:
        per_dim = [draw(_general_dim(cap)) for _ in range(dims)]
        groups = draw(st.sampled_from([1, 1, 2, 3]))
    return (*_columns(per_dim), groups)


@st.composite
def conv_cases(draw, integer_padding_only: bool = False, kinds=KINDS):
    dims = draw(st.sampled_from([1, 2, 3]))
    kind = draw(st.sampled_from(kinds))
    spatial, kernel, stride, padding, dilation, groups = draw(geometries(kind, dims))
    padding_arg: tuple[int, ...] | str = padding
    if kind == "general" and not integer_padding_only:
        choices = ["ints"]
        if all(u == 1 for u in stride):
            choices.append("same")
        if not any(padding):
            choices.append("valid")
        choice = draw(st.sampled_from(choices))
        padding_arg = padding if choice == "ints" else choice
    event(f"kind {kind}, {dims}-D")
    # Mostly every gradient; sometimes a subset, so needs_input_grad is exercised.
    every = st.just((True, True, True))
    needs_grad = draw(st.one_of(every, every, st.tuples(*[st.booleans()] * 3)))
    return ConvCase(
        dims=dims,
        n=draw(st.integers(1, 3)),
        c=draw(st.integers(1, 3)) * groups,
        k=draw(st.integers(1, 3)) * groups,
        spatial=spatial,
        kernel=kernel,
        stride=stride,
        padding=padding_arg,
        dilation=dilation,
        groups=groups,
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        bias=draw(st.booleans()),
        x_layout=draw(st.sampled_from([CF, CL])),
        w_layout=draw(st.sampled_from([CF, CF, CL])),
        x_view=draw(st.sampled_from(X_VIEWS)),
        w_view=draw(st.sampled_from(W_VIEWS)),
        dy_view=draw(st.sampled_from(DY_VIEWS)),
        needs_grad=needs_grad,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---- the properties --------------------------------------------------------------


@_settings(300)
@given(conv_cases())
# Found by a randomized run: torch's float64 weight gradient, the reference, was wrong
# here until the reference ran channels-first (measuring.verify.reference).
@example(ConvCase(dims=2, n=1, c=4, k=2, spatial=(1, 2), kernel=(1, 2), stride=(1, 2),
                  padding=(0, 0), dilation=(1, 1), groups=2, dtype=torch.float32, bias=False,
                  x_layout=Layout.CHANNELS_LAST, w_layout=Layout.CHANNELS_LAST,
                  x_view="spatial_transposed", w_view="dense", dy_view="dense",
                  needs_grad=(True, True, True), seed=0))  # fmt: skip
def test_conv_matches_torch_forward_and_every_gradient(case: ConvCase):
    check_against_torch(case)


@pytest.mark.parametrize("mode", ["immediate", "database", "find", "hybrid"])
def test_conv_matches_torch_in_every_selection_mode(mode, tmp_path, monkeypatch):
    """The same property through each selection mode, on a private find database.

    find and hybrid run the real find (random operands of each problem, every
    candidate timed) with one timed repetition per candidate, so the CPU can afford
    it; database mode reads what a find stored for the same case just before."""
    monkeypatch.setenv("GEMMCONV_DB", str(tmp_path / "find.sqlite"))
    monkeypatch.setitem(measure.DEFAULT_POLICY, "cpu", measure.TimingPolicy(warmup=0, reps=1))
    finddb.reset_db()
    choices: list[dispatch.Choice] = []
    choose = dispatch.choose

    def recorded(*args, **kwargs):
        choices.append(choose(*args, **kwargs))
        return choices[-1]

    monkeypatch.setattr(dispatch, "choose", recorded)

    @_settings(40)
    @given(conv_cases())
    def check(case: ConvCase) -> None:
        if mode == "database":
            with gemmconv.find_mode("find"):
                check_against_torch(case)
            dispatch.clear_cache()
        with gemmconv.find_mode(mode):
            check_against_torch(case)

    try:
        check()
    finally:
        finddb.reset_db()
    sources = {c.source for c in choices if c.mode == mode}
    expected = {"immediate": "estimate", "database": "database", "find": "find", "hybrid": "find"}
    assert expected[mode] in sources, sources


@_settings(120)
@given(conv_cases(integer_padding_only=True))
def test_every_applicable_solver_matches_float64(case: ConvCase):
    for solver_id in sorted(set(check_every_solver(case))):
        event(f"solver {solver_id}")


@pytest.mark.parametrize("solver_id", solver_ids())
@settings(
    max_examples=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(conv_cases(integer_padding_only=True), st.data())
def test_each_solver_forced_through_the_public_call(solver_id, case: ConvCase, data):
    """Each solver forced on random calls with non-dense operands (strided views,
    offsets, a sliced bias, expanded dY), forward and every gradient: what the eager
    road runs is the solver's prepared run, which the solver matrix checks on dense
    operands and a strided bias only (a Triton kernel that read a strided bias as
    dense had got through it). The Triton solvers run in Triton's interpreter, in its
    dtypes."""
    solver = get_solver(solver_id)
    interpreted_here = interpreted(solver)
    dtypes = INTERPRETER_DTYPES if interpreted_here else {torch.float32, torch.float64}
    dtype = data.draw(st.sampled_from(sorted(dtypes, key=str)))
    with pytest.MonkeyPatch.context() as patch:
        if interpreted_here:
            patch.setattr(type(solver), "devices", solver.devices | {"cpu"})
        patch.setenv("GEMMCONV_SOLVER", solver_id)
        dispatch.clear_cache()
        try:
            check_against_torch(dataclasses.replace(case, dtype=dtype))
        except dispatch.SolverNotApplicable:
            assume(False)
        finally:
            dispatch.clear_cache()


# Each example compiles Triton kernels for a shape no other example has: with 150 the
# test ran for more than two minutes on an H200 and past 300 s on an H100 without
# finishing (bench/NOTES.md). With 40 it passed in 85 s on an H100 (torch 2.11, from
# commit 1e09e80); the solver matrix covers every solver on CUDA on its fixed cases
# besides.
GPU_EXAMPLES = 40


@pytest.mark.gpu
@_settings(GPU_EXAMPLES)
@given(
    conv_cases(integer_padding_only=True),
    st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
)
def test_every_applicable_solver_matches_float64_on_cuda(case: ConvCase, dtype):
    """The same property on the GPU, where the Triton and cuBLAS solvers run, in fp32
    (TF32 as torch's convolutions allow), bf16 and fp16."""
    ran = check_every_solver(dataclasses.replace(case, dtype=dtype), "cuda")
    for solver_id in sorted(set(ran)):
        event(f"solver {solver_id}")


@pytest.mark.parametrize("kind", sorted(KIND_SOLVER))
@_settings(60)
@given(data=st.data())
def test_eligible_geometries_reach_their_solver(kind: str, data):
    """The generator's eligible kinds really are eligible, in every direction and layout,
    so the properties above exercise the GEMM solvers and not only the fallbacks."""
    case = data.draw(conv_cases(integer_padding_only=True, kinds=(kind,)))
    solver = get_solver(KIND_SOLVER[kind])
    for layout in (CF, CL):
        for direction in Direction:
            problem = case.problem(direction, layout)
            assert solver.not_supported_reasons(problem) == [], (problem.key(), kind)


def test_near_misses_are_rejected_by_the_patch_and_pointwise_rules():
    """A geometry with padding, dilation or groups never passes the patch rules."""
    patch = get_solver("patch")
    for padding, dilation, groups in (
        ((1, 0), (1, 1), 1),
        ((0, 0), (1, 2), 1),
        ((0, 0), (1, 1), 2),
    ):
        problem = gemmconv.ConvProblem.from_sizes(
            2, 4, 4, (6, 6), 2, stride=2, padding=padding, dilation=dilation, groups=groups
        )
        assert patch.not_supported_reasons(problem), problem.key()


# ---- random arguments, valid or not: gemmconv fails exactly where torch does --------


def _mostly(good, bad):
    """Draws from ``good`` about nine times in ten, else from ``bad``."""
    return st.sampled_from([*good] * 9 * len(bad) + [*bad] * len(good))


@st.composite
def raw_calls(draw):
    """Arguments of any kind, mostly valid: each draw is wrong with a small chance, so
    single mistakes, combined mistakes and valid calls all occur."""
    dims = draw(st.sampled_from([1, 2, 3]))
    rank = draw(_mostly([dims + 2], [dims + 1, dims + 3, dims]))
    groups = draw(_mostly([1, 1, 2], [3, 0, -1, 1.0, True]))
    g = groups if type(groups) is int and groups > 0 else 1  # for the shapes only
    n = draw(_mostly([1, 2], [0]))
    cg = draw(_mostly([1, 2], [0, 3]))
    c = draw(_mostly([cg * g], [cg + 1, 0]))
    k = draw(_mostly([g, 2 * g], [0, 3]))
    # No zero-size kernels: torch has no argument check for them, and its error comes
    # from whichever backend runs (oneDNN's RuntimeError, or an IndexError for an empty
    # batch, depending on earlier global state); test_validation covers gemmconv's.
    kernel = [draw(_mostly([1, 2, 3], [6])) for _ in range(dims)]
    spatial = [draw(_mostly([3, 5, 6], [0, 1, 2])) for _ in range(dims)]
    shape = {
        dims + 2: [n, c, *spatial],
        dims + 1: [c, *spatial],  # unbatched
        dims + 3: [1, n, c, *spatial],
        dims: spatial,
    }[rank]
    padding = draw(
        st.one_of(
            _mostly([0, 1, 2], [-1]),
            st.lists(_mostly([0, 1], [-1]), min_size=dims, max_size=dims).map(tuple),
            st.lists(st.just(0), min_size=1, max_size=dims + 1).map(tuple),
            _mostly(["same", "valid"], ["full", "SAME"]),
        )
    )
    return dict(
        dims=dims,
        input_shape=tuple(shape),
        weight_shape=(k, cg, *kernel),
        bias_size=draw(_mostly([None, k], [k + 1])),
        stride=draw(_mostly([1, 1, 2, 3], [0, -1, (1,) * (dims + 1), 1.5])),
        padding=padding,
        dilation=draw(_mostly([1, 1, 2], [0, -1])),
        groups=groups,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as error:  # the type is what is compared
        return None, error


def _call(**kwargs) -> dict:
    return {"bias_size": None, "stride": 1, "padding": 0, "groups": 1, "seed": 0, **kwargs}


@_settings(300)
@given(raw_calls())
# torch takes a zero dilation where the input is empty, and refuses a negative one there
# (found by a randomized run of this test).
@example(_call(dims=1, input_shape=(0, 1, 3), weight_shape=(1, 1, 1), dilation=0))
@example(_call(dims=3, input_shape=(0, 2, 5, 5, 5), weight_shape=(2, 2, 2, 2, 2),
               dilation=(1, 0, 1)))  # fmt: skip
@example(_call(dims=1, input_shape=(1, 0, 5), weight_shape=(2, 0, 2), dilation=0))
@example(_call(dims=2, input_shape=(0, 2, 5, 5), weight_shape=(2, 2, 2, 2), dilation=-1))
def test_random_arguments_fail_exactly_where_torch_fails(call):
    gen = torch.Generator().manual_seed(call["seed"])
    x = torch.rand(call["input_shape"], generator=gen, dtype=torch.float64) * 2 - 1
    w = torch.rand(call["weight_shape"], generator=gen, dtype=torch.float64) * 2 - 1
    b = None
    if call["bias_size"] is not None:
        b = torch.rand(call["bias_size"], generator=gen, dtype=torch.float64) * 2 - 1
    kwargs = {key: call[key] for key in ("stride", "padding", "dilation", "groups")}
    dims = call["dims"]
    expected, torch_error = _outcome(TORCH_CONV[dims], x, w, b, **kwargs)
    conv = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}[dims]
    got, error = _outcome(conv, x, w, b, **kwargs)
    if torch_error is not None:
        event(f"refused: {type(torch_error).__name__}")
        assert error is not None, f"torch refused ({torch_error}) but gemmconv ran: {call}"
        assert type(error) is type(torch_error), f"{error!r} vs torch's {torch_error!r}: {call}"
        return
    event("accepted")
    assert error is None, f"torch ran but gemmconv raised {error!r}: {call}"
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)


# ---- the modules ------------------------------------------------------------------


@st.composite
def module_configs(draw):
    dims = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.sampled_from([1, 1, 2]))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    padding_mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    patch_like = draw(st.booleans())
    if patch_like:
        stride = kernel
        padding: tuple[int, ...] | str = (0,) * dims
    elif all(u == 1 for u in stride) and draw(st.booleans()):
        padding = "same"
    else:
        padding = tuple(draw(st.integers(0, 1)) for _ in range(dims))
    cap = MAX_SPATIAL[dims]
    spatial = tuple(draw(st.integers(max(r, 2), cap)) for r in kernel)
    return dict(
        dims=dims,
        in_channels=draw(st.integers(1, 3)) * groups,
        out_channels=draw(st.integers(1, 3)) * groups,
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        dilation=1,
        groups=groups,
        bias=draw(st.booleans()),
        padding_mode=padding_mode,
        n=draw(st.integers(1, 2)),
        spatial=spatial,
        channels_last=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@_settings(80)
@given(module_configs())
def test_modules_match_torch_modules(config):
    """gemmconv.nn.Conv{d}d against torch.nn.Conv{d}d with the same state_dict: every
    padding mode, 'same' padding, groups, both layouts; torch's errors (reflect padding
    wider than the input) are raised with torch's type."""
    dims, dtype = config["dims"], config["dtype"]
    keys = (
        "in_channels",
        "out_channels",
        "kernel_size",
        "stride",
        "padding",
        "dilation",
        "groups",
        "bias",
        "padding_mode",
    )
    args = {key: config[key] for key in keys}
    torch_cls = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[dims]
    ours_cls = {1: gemmconv.nn.Conv1d, 2: gemmconv.nn.Conv2d, 3: gemmconv.nn.Conv3d}[dims]
    torch.manual_seed(config["seed"])
    reference = torch_cls(**args).to(torch.float64)
    magnitudes = torch_cls(**args).to(torch.float64)  # |parameters|: the error scale
    theirs = torch_cls(**args).to(dtype)
    ours = ours_cls(**args).to(dtype)
    state = reference.state_dict()
    for module in (theirs, ours):
        module.load_state_dict(state)
    magnitudes.load_state_dict({name: t.abs() for name, t in state.items()})

    gen = torch.Generator().manual_seed(config["seed"])
    shape = (config["n"], config["in_channels"], *config["spatial"])
    x64 = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
    if config["channels_last"] and dims > 1:
        x64 = x64.to(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    runs = {}
    for name, module, x in (
        ("ours", ours, x64.to(dtype)),
        ("torch", theirs, x64.to(dtype)),
        ("ref", reference, x64.clone()),
        ("scale", magnitudes, x64.abs()),
    ):
        x.requires_grad_(True)
        y, error = _outcome(module, x)
        runs[name] = (x, y, error)
    torch_error = runs["torch"][2]
    if torch_error is not None:
        assert type(runs["ours"][2]) is type(torch_error), (runs["ours"][2], torch_error)
        return
    assert runs["ours"][2] is None, runs["ours"][2]
    (x, y, _), (x_ref, y_ref, _), (x_scale, y_scale, _) = runs["ours"], runs["ref"], runs["scale"]
    assert y.shape == runs["torch"][1].shape
    assert_matches_reference("module forward", y, y_ref, y_scale, ModuleConfig(config))
    dy = torch.rand(y.shape, generator=gen, dtype=torch.float64) * 2 - 1
    y.backward(dy.to(dtype))
    y_ref.backward(dy)
    y_scale.backward(dy.abs())
    pairs = [("input grad", x.grad, x_ref.grad, x_scale.grad)]
    ref_params, scale_params = (
        dict(reference.named_parameters()),
        dict(magnitudes.named_parameters()),
    )
    for name, p in ours.named_parameters():
        pairs.append((f"{name} grad", p.grad, ref_params[name].grad, scale_params[name].grad))
    for name, mine, ref, scale in pairs:
        assert_matches_reference(name, mine, ref, scale, ModuleConfig(config))


class ModuleConfig(dict):
    """A module config dict with the ``dtype`` attribute assert_matches_reference reads."""

    @property
    def dtype(self) -> torch.dtype:
        return self["dtype"]
