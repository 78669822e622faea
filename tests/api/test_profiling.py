"""gemmconv.profile on small models on the CPU: the per-convolution rows (names, what
convert() swaps and why not, the solvers explain names), times that are positive and
finite, the whole-model steps, JSON, progress, and the model passed in left alone."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import gemmconv
from gemmconv.profiling import DIRECTIONS

FAST = dict(steps=2, warmup=1)


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _assert_times(p: gemmconv.ModelProfile, train: bool = True) -> None:
    modes = ("forward", "forward_backward") if train else ("forward",)
    for row in p.convs:
        for mode in modes:
            assert _positive(row.torch_ms[mode]), (row.name, mode, row.torch_ms)
            if row.reducible:
                assert _positive(row.gemmconv_ms[mode]), (row.name, mode, row.gemmconv_ms)
            else:
                assert mode not in row.gemmconv_ms
    steps = (p.forward, p.train_step) if train else (p.forward,)
    for step in steps:
        assert step is not None and step.steps == p.steps
        for value in (step.torch_ms, step.gemmconv_ms, step.torch_min_ms, step.gemmconv_min_ms):
            assert _positive(value)
        assert step.torch_min_ms <= step.torch_ms and _positive(step.speedup)


def _vit() -> torch.nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)


def test_a_timm_vit_profile_names_its_patch_embed_and_the_solvers_explain_names():
    torch.manual_seed(0)
    model = _vit()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    p = gemmconv.profile(model, x, **FAST)

    assert [row.name for row in p.convs] == ["patch_embed.proj"]
    (row,) = p.convs
    assert row.reducible and row.problem_class == "patch" and row.reason is None
    assert row.input_shape == (2, 3, 32, 32) and row.weight_shape == (192, 3, 16, 16)
    assert row.stride == (16, 16) and row.calls == 1 and not row.needs_dx
    assert row.module_class == "Conv2d" and row.dtype == "fp32"
    w = model.patch_embed.proj.weight
    explained = gemmconv.explain(x, w, model.patch_embed.proj.bias, stride=16)
    assert row.solvers == {d: explained[d].solver for d in DIRECTIONS}
    assert set(row.solvers.values()) <= set(gemmconv.solver_ids())
    _assert_times(p)
    assert p.rms_vs_torch is not None and p.rms_vs_torch < 1e-5
    assert "swapped  patch_embed.proj" in p.conversion

    text = str(p)
    assert "patch_embed.proj" in text and "training step" in text
    data = json.loads(json.dumps(p.to_dict()))
    assert data["convs"][0]["solvers"] == row.solvers
    assert data["convs"][0]["speedup"]["forward"] == pytest.approx(row.speedup("forward"))
    assert data["train_step"]["speedup"] == pytest.approx(p.train_step.speedup)

    # The model passed in is neither converted nor trained.
    assert type(model.patch_embed.proj) is torch.nn.Conv2d
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Mixed(torch.nn.Module):
    """A 3x3 convolution (left to torch), two identical 1x1s (one problem), a strided
    1x1, batch norm (whose statistics a training-mode forward would move) and a Conv1d
    called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.a = torch.nn.Conv2d(8, 8, 1)
        self.b = torch.nn.Conv2d(8, 8, 1)
        self.down = torch.nn.Conv2d(8, 16, 1, stride=2)
        self.seq = torch.nn.Conv1d(16, 16, 1)
        self.unused = torch.nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(input=self.a(self.bn(self.stem(x))))  # by keyword, too
        x = self.down(x).flatten(2)
        return self.seq(self.seq(x))


def test_rows_say_why_a_convolution_is_left_alone_and_share_one_problems_times():
    torch.manual_seed(0)
    model = _Mixed()
    model.bn.running_mean.fill_(0.5)  # far from a batch's own mean
    p = gemmconv.profile(model, torch.randn(2, 3, 8, 8), **FAST)

    rows = {row.name: row for row in p.convs}
    assert list(rows) == ["stem", "a", "b", "down", "seq"]  # call order
    assert p.not_called == ["unused"]
    stem = rows["stem"]
    assert not stem.reducible and stem.solvers == {} and "padding=(1, 1)" in stem.reason
    assert stem.gemmconv_ms == {} and not stem.needs_dx
    assert rows["a"].problem_class == rows["b"].problem_class == "pointwise"
    assert rows["a"].needs_dx and rows["b"].same_as == "a"
    assert rows["b"].torch_ms == rows["a"].torch_ms and rows["b"].same_as is not None
    assert rows["down"].problem_class == "strided pointwise" and rows["down"].stride == (2, 2)
    assert rows["seq"].calls == 2 and rows["seq"].module_class == "Conv1d"
    for row in rows.values():
        if row.reducible:
            assert set(row.solvers) == set(DIRECTIONS)
    _assert_times(p)
    # Recorded in eval mode: the converted copy's batch norm has the same statistics.
    assert p.rms_vs_torch is not None and p.rms_vs_torch < 1e-5
    assert "left to torch:" in str(p) and "never called by the forward: unused" in str(p)


def test_forward_only_and_progress_reaching_its_total():
    calls = []
    p = gemmconv.profile(
        _Mixed(), torch.randn(1, 3, 8, 8), train=False, steps=1, warmup=0,
        progress=lambda done, total, what: calls.append((done, total, what)),
    )  # fmt: skip
    _assert_times(p, train=False)
    assert p.train_step is None and p.train_note and "fwd+bwd" not in str(p)
    assert all("forward_backward" not in row.torch_ms for row in p.convs)
    dones = [done for done, _, _ in calls]
    assert dones == list(range(1, len(calls) + 1)) and calls[-1][0] == calls[-1][1]
    assert len({total for _, total, _ in calls}) == 1


def test_a_frozen_model_has_no_training_step_and_says_why():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 2, stride=2)).requires_grad_(False)
    p = gemmconv.profile(model, torch.randn(1, 3, 4, 4), steps=1, warmup=0)
    assert p.train_step is None and "needs a gradient" in p.train_note
    assert p.forward is not None and "forward_backward" not in p.convs[0].torch_ms


def test_a_model_without_convolutions_is_said_so_and_timed_not_at_all():
    p = gemmconv.profile(torch.nn.Linear(4, 4), torch.randn(2, 4))
    assert not p.has_convolutions and p.convs == []
    assert p.forward is None and p.train_step is None
    assert str(p) == "no torch.nn.Conv1d/2d/3d ran in the forward: nothing for gemmconv to convert"


def test_bf16_runs_under_autocast_and_the_rows_say_so():
    p = gemmconv.profile(_Mixed(), torch.randn(1, 3, 8, 8), dtype="bf16", steps=1, warmup=0)
    assert p.autocast and p.dtype == "bf16"
    assert {row.dtype for row in p.convs} == {"bf16"}
    _assert_times(p)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "steps=0: expected an int >= 1"),
        (dict(warmup=-1), "warmup=-1: expected an int >= 0"),
        (dict(dtype="fp64"), "dtype='fp64': expected"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gemmconv.profile(_Mixed(), torch.randn(1, 3, 8, 8), **kwargs)


def test_inputs_and_model_are_checked():
    with pytest.raises(ValueError, match="expected at least one example input"):
        gemmconv.profile(_Mixed())
    with pytest.raises(TypeError, match="model=function: expected a torch.nn.Module"):
        gemmconv.profile(lambda x: x, torch.randn(1))
