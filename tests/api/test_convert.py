"""convert() / revert(): which convolutions are swapped and why the others are not,
in-place swaps that keep Parameter objects (optimizer state, parametrizations), the
include/exclude filters, and models that reshape their input first."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch.nn.utils import parametrize

import gemmconv
from gemmconv.measuring.verify import rms_range, tolerance

from conftest import GemmconvOpLog

TOL = tolerance(torch.float32, "cpu")


class Subclassed(torch.nn.Conv2d):
    """A torch Conv2d subclass with a forward of its own: never swapped."""

    def forward(self, x):
        return super().forward(x) * 2


def _mixed_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, kernel_size=4, stride=4),  # 0: patch
        torch.nn.ModuleList(
            [
                torch.nn.Conv2d(8, 8, kernel_size=1),  # 1.0: pointwise
                torch.nn.Conv2d(8, 8, kernel_size=3, padding=1),  # 1.1: padded 3x3
                torch.nn.Conv2d(8, 8, kernel_size=1, groups=2),  # 1.2: grouped
            ]
        ),
        torch.nn.Conv2d(8, 16, kernel_size=1, stride=2),  # 2: strided pointwise
        torch.nn.ConvTranspose2d(16, 8, kernel_size=2, stride=2),  # 3: transposed
        Subclassed(8, 8, kernel_size=1),  # 4: subclass
        torch.nn.Conv2d(8, 8, kernel_size=2, stride=2, padding=1, padding_mode="reflect"),  # 5
        torch.nn.Conv1d(8, 8, kernel_size=3, stride=2),  # 6: stride != kernel
    )


def _run_mixed(model, x):
    y = model[0](x)
    for conv in model[1]:
        y = conv(y)
    y = model[2](y)
    y = model[3](y)
    y = model[4](y)
    y = model[5](y)
    return model[6](y.flatten(2))


def test_report_lists_swapped_and_why_the_rest_were_left():
    model = _mixed_model()
    report = gemmconv.convert(model)
    assert report.swapped_names == ["0", "1.0", "2"]
    assert [s.problem_class for s in report.swapped] == ["patch", "pointwise", "strided pointwise"]
    reasons = {s.name: s.reason for s in report.skipped}
    assert set(reasons) == {"1.1", "1.2", "3", "4", "5", "6"}
    assert "padding" in reasons["1.1"]
    assert "groups=2" in reasons["1.2"]
    assert "transposed" in reasons["3"]
    assert "Subclassed" in reasons["4"]
    assert "padding" in reasons["5"]
    assert "stride" in reasons["6"]
    text = str(report)
    assert "3 swapped, 6 left alone" in text
    assert "swapped  0: Conv2d(3, 8, kernel_size=(4, 4), stride=(4, 4)) -> patch" in text
    assert type(model[0]) is gemmconv.nn.Conv2d
    assert type(model[1][1]) is torch.nn.Conv2d
    assert type(model[4]) is Subclassed


def test_converted_model_matches_and_keeps_parameters_and_repr():
    model = _mixed_model()
    reference = copy.deepcopy(model).double()
    params_before = {name: p for name, p in model.named_parameters()}
    repr_before = repr(model)
    gemmconv.convert(model)
    assert repr(model) == repr_before
    assert all(p is params_before[name] for name, p in model.named_parameters())
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    y = _run_mixed(model, x)
    y64 = _run_mixed(reference, x.double())
    assert rms_range(y, y64) <= TOL
    y.square().sum().backward()
    y64.square().sum().backward()
    for (name, p), p64 in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert rms_range(p.grad, p64.grad) <= TOL, name


def test_optimizer_created_before_convert_keeps_working():
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 2, 2), torch.nn.Flatten(), torch.nn.Linear(16, 2)
    )
    twin = copy.deepcopy(model)
    x = torch.rand(3, 3, 4, 4, generator=torch.Generator().manual_seed(3))

    def train(m, optimizer, steps):
        for _ in range(steps):
            optimizer.zero_grad()
            m(x).square().mean().backward()
            optimizer.step()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 1)  # optimizer state exists before the swap
    gemmconv.convert(model)
    train(model, optimizer, 2)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    train(twin, twin_optimizer, 3)
    assert type(model[0]) is gemmconv.nn.Conv2d
    assert optimizer.state[model[0].weight]["step"].item() == 3
    for p, p_twin in zip(model.parameters(), twin.parameters(), strict=True):
        assert rms_range(p, p_twin) <= TOL


class LowRankDelta(torch.nn.Module):
    """A LoRA-style parametrization: weight + B @ A, reshaped to the weight's shape."""

    def __init__(self, out_features: int, in_features: int, rank: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.a = torch.nn.Parameter(torch.rand(rank, in_features, generator=g) - 0.5)
        self.b = torch.nn.Parameter(torch.rand(out_features, rank, generator=g) - 0.5)

    def forward(self, weight):
        return weight + (self.b @ self.a).view(weight.shape)


def test_parametrized_weight_survives_convert_and_revert():
    torch.manual_seed(5)
    conv = torch.nn.Conv2d(3, 6, kernel_size=2, stride=2)
    parametrize.register_parametrization(conv, "weight", LowRankDelta(6, 3 * 2 * 2))
    conv.parametrizations.weight.original.requires_grad_(False)  # frozen base, LoRA trains
    model = torch.nn.Sequential(conv)
    reference = copy.deepcopy(model)
    lora_a = conv.parametrizations.weight[0].a
    report = gemmconv.convert(model)
    assert report.swapped_names == ["0"]
    assert isinstance(model[0], gemmconv.nn.Conv2d)
    assert parametrize.is_parametrized(model[0], "weight")
    assert model[0].parametrizations.weight[0].a is lora_a
    x = torch.rand(2, 3, 6, 6, generator=torch.Generator().manual_seed(6))
    y, y_ref = model(x), reference(x)
    assert rms_range(y, y_ref) <= TOL
    y.sum().backward()
    y_ref.sum().backward()
    ref_a = reference[0].parametrizations.weight[0].a
    assert rms_range(lora_a.grad, ref_a.grad) <= TOL
    assert model[0].parametrizations.weight.original.grad is None
    assert gemmconv.revert(model) == ["0"]
    assert type(model[0]).__bases__ == (torch.nn.Conv2d,)
    assert parametrize.is_parametrized(model[0], "weight")
    assert rms_range(model(x), y_ref) <= TOL


def test_include_and_exclude_filters():
    names = ["0", "1.0", "2"]
    assert gemmconv.convert(_mixed_model(), include="1.*").swapped_names == ["1.0"]
    assert gemmconv.convert(_mixed_model(), include=["0", "2"]).swapped_names == ["0", "2"]
    assert gemmconv.convert(_mixed_model(), exclude="1.*").swapped_names == ["0", "2"]
    report = gemmconv.convert(_mixed_model(), exclude=lambda name, m: m.stride != (1, 1))
    assert report.swapped_names == ["1.0"]
    assert {s.name: s.reason for s in report.skipped}["0"] == "matched by exclude"
    assert gemmconv.convert(_mixed_model()).swapped_names == names
    with pytest.raises(TypeError, match="include=.*glob pattern"):
        gemmconv.convert(_mixed_model(), include=[3])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": 3}, "include=3: expected a glob pattern (str), a list of them, or a "
                         "callable (name, module) -> bool; got int"),
        ({"exclude": 2.5}, "exclude=2.5: expected a glob pattern"),
        ({"include": b"0"}, "include=b'0': expected a glob pattern (str)"),
        ({"exclude": ["0", None]}, "got None (NoneType) among the patterns"),
    ],
)  # fmt: skip
def test_a_filter_of_the_wrong_kind_is_refused_before_any_swap(kwargs, message):
    model = _mixed_model()
    with pytest.raises(TypeError) as error:
        gemmconv.convert(model, **kwargs)
    assert message in str(error.value)
    assert type(model[0]) is torch.nn.Conv2d


def test_revert_restores_torch_classes_and_convert_is_idempotent():
    model = _mixed_model()
    gemmconv.convert(model)
    again = gemmconv.convert(model)
    assert again.swapped_names == []
    assert {s.name for s in again.skipped if s.reason == "already a gemmconv module"} == {
        "0",
        "1.0",
        "2",
    }
    assert gemmconv.revert(model) == ["0", "1.0", "2"]
    assert type(model[0]) is torch.nn.Conv2d and type(model[2]) is torch.nn.Conv2d
    assert "_gemmconv_last_input" not in vars(model[0])


class _UnpicklerWithoutGemmconv(pickle.Unpickler):
    """Loads a pickle as a process without gemmconv installed would: any gemmconv name fails."""

    def find_class(self, module, name):
        if module.split(".")[0] == "gemmconv":
            raise pickle.UnpicklingError(f"the pickle needs {module}.{name}")
        return super().find_class(module, name)


def test_reverted_model_pickles_without_gemmconv_after_running():
    model = _mixed_model()
    x = torch.randn(2, 3, 16, 16)
    gemmconv.convert(model)
    _run_mixed(model, x)  # an eager forward records runtime state on each gemmconv module
    gemmconv.revert(model)
    data = pickle.dumps(model)
    assert b"gemmconv" not in data
    loaded = _UnpicklerWithoutGemmconv(io.BytesIO(data)).load()
    torch.testing.assert_close(_run_mixed(loaded, x), _run_mixed(model, x), rtol=0, atol=0)


class ReshapingPatchEmbed(torch.nn.Module):
    """Qwen2-VL's patch embed: flat patches viewed as (-1, 3, 2, 14, 14), a point-output Conv3d."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj = torch.nn.Conv3d(3, dim, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False)
        self.dim = dim

    def forward(self, flat_patches):
        x = flat_patches.view(-1, 3, 2, 14, 14)
        return self.proj(x).view(-1, self.dim)


def test_model_that_reshapes_its_input_first():
    torch.manual_seed(7)
    model = ReshapingPatchEmbed()
    reference = copy.deepcopy(model).double()
    assert gemmconv.convert(model).swapped_names == ["proj"]
    flat = torch.rand(5, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(8)) * 2 - 1
    flat64 = flat.double().requires_grad_()
    flat.requires_grad_()
    y, y64 = model(flat), reference(flat64)
    assert rms_range(y, y64) <= TOL
    y.sum().backward()
    y64.sum().backward()
    assert rms_range(flat.grad, flat64.grad) <= TOL
    assert rms_range(model.proj.weight.grad, reference.proj.weight.grad) <= TOL
    assert model.proj.solvers()["forward"].solver == "point_output"


def test_root_module_itself_can_be_converted():
    conv = torch.nn.Conv1d(4, 4, kernel_size=1)
    report = gemmconv.convert(conv)
    assert report.swapped_names == [""]
    assert "swapped  <root>" in str(report)
    assert type(conv) is gemmconv.nn.Conv1d


def test_patch_embed_of_pixels_skips_backward_data_and_frozen_weights_skip_wgrad():
    torch.manual_seed(9)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, kernel_size=4, stride=4),  # pixels in: no dx needed
        torch.nn.Conv2d(8, 8, kernel_size=1),  # frozen below: no dW needed
        torch.nn.Conv2d(8, 4, kernel_size=1),
    )
    gemmconv.convert(model)
    model[1].weight.requires_grad_(False)
    pixels = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(10))
    with GemmconvOpLog() as log:
        model(pixels).sum().backward()
    assert log.calls.count("conv_forward") == 3
    assert log.calls.count("conv_backward_data") == 2  # into layers 1 and 2, not the pixels
    assert log.calls.count("conv_backward_weights") == 2  # layers 0 and 2, not the frozen 1
    assert model[1].weight.grad is None and model[1].bias.grad is not None


# ---- what runs where ----------------------------------------------------------------


def _label(solver_ids: tuple[str, ...]) -> str:
    return " or ".join(sorted({"torch" if s == "vendor" else "GEMM" for s in solver_ids}))


def test_report_says_what_runs_on_the_weights_device_and_on_cuda():
    """A ViT-S/16 patch embedding on the CPU: the report once said only '-> patch',
    while the CPU runs torch's convolution in some directions. It now names, per
    direction, what the cost model picks on the weight's device and on CUDA, and
    agrees with explain() for an input of one of its sizes (batch 8, 14x14 patches)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 384, kernel_size=16, stride=16))
    report = gemmconv.convert(model)
    swapped = report.swapped[0]
    assert (swapped.device, swapped.dtype) == ("cpu", "float32")
    x = torch.empty(8, 3, 224, 224)
    with gemmconv.find_mode("immediate"):
        explained = gemmconv.explain(x, model[0].weight, model[0].bias, stride=16)
    directions = ["forward", "backward_data", "backward_weights"]
    assert list(swapped.solvers) == directions == list(swapped.solvers_on_cuda)
    for direction in directions:
        assert explained[direction].solver in swapped.solvers[direction]
        assert explained.on_cuda[direction].solver in swapped.solvers_on_cuda[direction]
    text = str(report)
    assert "swapped  0: Conv2d(3, 384, kernel_size=(16, 16), stride=(16, 16)) -> patch" in text
    here = ", ".join(
        f"{short} {_label(swapped.solvers[d])}"
        for short, d in zip(["forward", "dX", "dW"], directions, strict=True)
    )
    on_cuda = ", ".join(
        f"{short} {_label(swapped.solvers_on_cuda[d])}"
        for short, d in zip(["forward", "dX", "dW"], directions, strict=True)
    )
    assert f"runs on cpu (float32): {here}; on CUDA: {on_cuda}" in text
    assert "GEMM = a gemmconv solver, torch = torch's own convolution" in text


def test_report_follows_the_models_dtype_and_weight_layout():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, kernel_size=4, stride=4)).bfloat16()
    report = gemmconv.convert(model, memory_format=torch.channels_last)
    swapped = report.swapped[0]
    assert swapped.dtype == "bfloat16"
    x = torch.empty(8, 3, 56, 56, dtype=torch.bfloat16)
    with gemmconv.find_mode("immediate"):
        explained = gemmconv.explain(x, model[0].weight, model[0].bias, stride=4)
    for direction, choice in explained.items():
        assert choice.solver in swapped.solvers[direction]
    assert "-> patch, weight channels_last\n           runs on cpu (bfloat16): " in str(report)


def test_report_of_a_model_with_no_solver_here_still_says_what_cuda_would_run():
    """A model built on the meta device has no solver there: the report says what
    CUDA would run and nothing of meta, and convert() does not fail."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, kernel_size=4, stride=4))
    report = gemmconv.convert(model)
    assert report.swapped[0].solvers == {}
    assert set(report.swapped[0].solvers_on_cuda) == {
        "forward",
        "backward_data",
        "backward_weights",
    }
    line = str(report).splitlines()[2]
    assert line.strip().startswith("on CUDA: forward ") and "meta" not in line


def test_report_survives_a_forced_solver_that_does_not_apply(monkeypatch):
    """GEMMCONV_SOLVER forcing a solver a swapped module cannot use: the convolution
    will say so when it runs; convert() swaps and reports the rest."""
    monkeypatch.setenv("GEMMCONV_SOLVER", "pointwise")
    model = _mixed_model()
    report = gemmconv.convert(model)
    assert report.swapped_names == ["0", "1.0", "2"]
    by_name = {s.name: s for s in report.swapped}
    assert by_name["0"].solvers == {}  # a 4x4 patch: pointwise does not apply
    assert set(by_name["1.0"].solvers["forward"]) == {"pointwise"}
    assert by_name["0"].solvers_on_cuda  # CUDA's estimate ignores the forcing


def test_include_that_matches_no_convolution_warns_naming_the_patterns():
    with pytest.warns(UserWarning, match=r"pattern\(s\) 'blocks\.\*', 'nope' matched no conv"):
        report = gemmconv.convert(_mixed_model(), include=["blocks.*", "1.*", "nope"])
    assert report.swapped_names == ["1.0"]
    with pytest.warns(UserWarning, match="the predicate accepted no convolution"):
        gemmconv.convert(_mixed_model(), include=lambda name, module: False)


def test_include_matching_a_convolution_it_cannot_swap_and_exclude_matching_none_are_quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # "1.1" is a padded 3x3: matched, left alone with its reason, no warning.
        report = gemmconv.convert(_mixed_model(), include=["1.1"])
        assert report.swapped_names == []
        assert {s.name: s.reason for s in report.skipped}["1.1"].startswith("padding=")
        gemmconv.convert(_mixed_model(), exclude=["nothing.*"])
