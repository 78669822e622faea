"""Token-major output: convert(memory_format=...) and gemmconv.nn's memory_format=
lay weights out channels-last in place (Parameter objects and optimizers intact), so a
patch embed's output is channels-last and a ViT's flatten(2).transpose(1, 2) is a view;
bad values are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.utils import parametrize

import gemmconv
from gemmconv.measuring.verify import rms_range, tolerance

TOL = tolerance(torch.float32, "cpu")


def _uniform(*shape, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _patch_convs() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {
            "one": torch.nn.Conv1d(3, 8, kernel_size=4, stride=4),
            "two": torch.nn.Conv2d(3, 8, kernel_size=4, stride=4),
            "three": torch.nn.Conv3d(3, 8, kernel_size=2, stride=2),
            "padded": torch.nn.Conv2d(3, 8, kernel_size=3, padding=1),  # not swapped
        }
    )


def test_convert_lays_out_2d_and_3d_weights_channels_last_and_reports_it():
    convs = _patch_convs()
    params = {name: p for name, p in convs.named_parameters()}
    report = gemmconv.convert(convs, memory_format=torch.channels_last)
    assert convs["two"].weight.is_contiguous(memory_format=torch.channels_last)
    assert not convs["two"].weight.is_contiguous()
    assert convs["three"].weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert not convs["three"].weight.is_contiguous()
    # A 1-D weight has no channels-last format and a module left alone is not touched.
    assert convs["one"].weight.is_contiguous()
    assert convs["padded"].weight.is_contiguous()
    assert all(p is params[name] for name, p in convs.named_parameters())
    formats = {s.name: s.weight_format for s in report.swapped}
    assert formats["two"] == "channels_last"
    assert formats["three"] == "channels_last_3d"
    assert "1-D" in formats["one"] and "left as it is" in formats["one"]
    assert "swapped  two: Conv2d(3, 8, kernel_size=(4, 4), stride=(4, 4)) -> patch, weight " \
        "channels_last" in str(report)  # fmt: skip


def test_channels_last_3d_request_means_channels_last_for_conv2d_too():
    convs = _patch_convs()
    gemmconv.convert(convs, memory_format=torch.channels_last_3d)
    assert convs["two"].weight.is_contiguous(memory_format=torch.channels_last)
    assert convs["three"].weight.is_contiguous(memory_format=torch.channels_last_3d)


def test_default_leaves_weights_and_contiguous_format_makes_them_contiguous():
    convs = _patch_convs()
    convs["two"].weight.data = convs["two"].weight.data.contiguous(
        memory_format=torch.channels_last
    )
    report = gemmconv.convert(copy.deepcopy(convs))
    assert all(s.weight_format == "" for s in report.swapped)
    assert "weight" not in str(report)
    # convert() with no memory_format leaves a channels-last weight as it found it.
    kept = copy.deepcopy(convs)
    gemmconv.convert(kept)
    assert kept["two"].weight.is_contiguous(memory_format=torch.channels_last)
    assert not kept["two"].weight.is_contiguous()
    report = gemmconv.convert(convs, memory_format=torch.contiguous_format)
    assert convs["two"].weight.is_contiguous()
    assert {s.weight_format for s in report.swapped} == {"contiguous_format"}


def test_parametrized_weight_is_left_to_its_parametrization():
    conv = torch.nn.Conv2d(3, 4, kernel_size=2, stride=2)
    parametrize.register_parametrization(conv, "weight", torch.nn.Identity())
    report = gemmconv.convert(conv, memory_format=torch.channels_last)
    assert "parametrized" in report.swapped[0].weight_format
    assert conv.parametrizations.weight.original.is_contiguous()


@pytest.mark.parametrize(
    "value, error, words",
    [
        ("channels_last", TypeError, ["memory_format='channels_last'", "of type str"]),
        (4, TypeError, ["memory_format=4", "of type int"]),
        (torch.preserve_format, ValueError, ["memory_format=torch.preserve_format"]),
    ],
)
def test_bad_memory_format_values_are_refused_by_name(value, error, words):
    with pytest.raises(error) as convert_error:
        gemmconv.convert(_patch_convs(), memory_format=value)
    with pytest.raises(error) as module_error:
        gemmconv.nn.Conv2d(3, 8, 4, 4, memory_format=value)
    for message in (str(convert_error.value), str(module_error.value)):
        assert all(w in message for w in words), message
        assert "torch.channels_last" in message  # what was expected
    assert str(convert_error.value).startswith("convert: ")
    assert str(module_error.value).startswith("Conv2d: ")


def test_bad_value_changes_nothing():
    convs = _patch_convs()
    with pytest.raises(TypeError):
        gemmconv.convert(convs, memory_format="channels_last")
    assert type(convs["two"]) is torch.nn.Conv2d  # refused before any swap


def test_module_constructors_take_memory_format():
    two = gemmconv.nn.Conv2d(3, 8, 4, stride=4, memory_format=torch.channels_last)
    three = gemmconv.nn.Conv3d(3, 8, 2, stride=2, memory_format=torch.channels_last_3d)
    assert two.weight.is_contiguous(memory_format=torch.channels_last)
    assert not two.weight.is_contiguous()
    assert three.weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert gemmconv.nn.Conv1d(3, 8, 4, memory_format=torch.contiguous_format).weight.is_contiguous()
    assert gemmconv.nn.Conv2d(3, 8, 4, memory_format=None).weight.is_contiguous()
    # Same init as torch's, whatever the layout.
    torch.manual_seed(3)
    laid_out = gemmconv.nn.Conv2d(3, 8, 4, stride=4, memory_format=torch.channels_last)
    torch.manual_seed(3)
    plain = torch.nn.Conv2d(3, 8, 4, stride=4)
    assert torch.equal(laid_out.weight, plain.weight) and torch.equal(laid_out.bias, plain.bias)
    x = _uniform(2, 3, 16, 16, seed=1)
    y = laid_out(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert rms_range(y, plain(x)) <= TOL


@pytest.mark.parametrize(
    "cls, value, expected",
    [
        (gemmconv.nn.Conv1d, torch.channels_last, "no channels-last format for a 1-D"),
        (gemmconv.nn.Conv1d, torch.channels_last_3d, "no channels-last format for a 1-D"),
        (gemmconv.nn.Conv2d, torch.channels_last_3d, "expected torch.channels_last,"),
        (gemmconv.nn.Conv3d, torch.channels_last, "expected torch.channels_last_3d,"),
    ],
)
def test_module_refuses_a_format_its_weight_cannot_have(cls, value, expected):
    with pytest.raises(ValueError) as error:
        cls(3, 8, 2, memory_format=value)
    message = str(error.value)
    assert message.startswith(f"{cls.__name__}: memory_format={value}"), message
    assert expected in message, message


@pytest.mark.parametrize("optimizer_kwargs", [{"foreach": True}, {"fused": True}], ids=str)
def test_optimizer_created_before_convert_keeps_its_parameters(optimizer_kwargs):
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 2, 2), torch.nn.Flatten(), torch.nn.Linear(16, 2)
    )
    twin = copy.deepcopy(model)
    x = _uniform(3, 3, 4, 4, seed=3)

    def train(m, optimizer, steps):
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
            optimizer.step()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **optimizer_kwargs)
    weight = model[0].weight
    gemmconv.convert(model, memory_format=torch.channels_last)
    assert model[0].weight is weight and optimizer.param_groups[0]["params"][0] is weight
    train(model, optimizer, 3)
    train(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, **optimizer_kwargs), 3)
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert optimizer.state[weight]["step"].item() == 3
    for p, p_twin in zip(model.parameters(), twin.parameters(), strict=True):
        assert rms_range(p, p_twin) <= TOL


def test_existing_gradient_follows_the_weight_and_a_warning_names_it():
    conv = torch.nn.Conv2d(3, 4, 2, 2)
    conv(_uniform(2, 3, 4, 4, seed=4)).sum().backward()
    grad = conv.weight.grad.clone()
    with pytest.warns(UserWarning, match=r"<root>\.weight already has a gradient"):
        gemmconv.convert(conv, memory_format=torch.channels_last)
    assert conv.weight.grad.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(conv.weight.grad, grad)


def _check_converted_timm_vit(device: str, dtype: torch.dtype) -> None:
    """A converted channels-last timm ViT: token-major patch embed output, and output
    and every gradient as close to float64 as the unconverted model's (or within the
    dtype's tolerance)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2)
    model.train()
    unconverted = copy.deepcopy(model).to(device, dtype)
    reference = copy.deepcopy(model).to(device, torch.float64)
    report = gemmconv.convert(model, memory_format=torch.channels_last)
    model.to(device, dtype)
    assert report.swapped_names == ["patch_embed.proj"]
    assert report.swapped[0].weight_format == "channels_last"
    assert model.patch_embed.proj.weight.is_contiguous(memory_format=torch.channels_last)

    seen = []
    model.patch_embed.proj.register_forward_hook(lambda m, args, out: seen.append(out))
    x = _uniform(2, 3, 32, 32, seed=1).to(device)
    y = model(x.to(dtype))
    y_unconverted = unconverted(x.to(dtype))
    y64 = reference(x.double())

    assert model.patch_embed.proj._gemmconv_last_input is not None  # it ran on gemmconv
    # The GEMM wrote tokens as rows: [N, D, H, W] in channels-last memory, so timm's
    # flatten(2).transpose(1, 2) is a view of it, contiguous as [N, L, D].
    (embedded,) = seen
    assert embedded.shape == (2, 192, 2, 2)
    assert embedded.stride() == (4 * 192, 1, 2 * 192, 192)
    tokens = embedded.flatten(2).transpose(1, 2)
    assert tokens.is_contiguous() and tokens.data_ptr() == embedded.data_ptr()

    tol = tolerance(dtype, device)
    error, unconverted_error = rms_range(y, y64), rms_range(y_unconverted, y64)
    assert error <= max(tol, 2 * unconverted_error), (error, unconverted_error)
    cotangent = _uniform(*y.shape, seed=2).to(device)
    y.backward(cotangent.to(dtype))
    y_unconverted.backward(cotangent.to(dtype))
    y64.backward(cotangent.double())
    assert model.patch_embed.proj.weight.grad.is_contiguous(memory_format=torch.channels_last)
    for (name, p), p_unconverted, p64 in zip(
        model.named_parameters(), unconverted.parameters(), reference.parameters(), strict=True
    ):
        error = rms_range(p.grad, p64.grad)
        unconverted_error = rms_range(p_unconverted.grad, p64.grad)
        assert error <= max(tol, 2 * unconverted_error), (name, error, unconverted_error)


def test_converted_timm_vit_is_token_major_and_matches_the_unconverted_model():
    _check_converted_timm_vit("cpu", torch.float32)


@pytest.mark.gpu
def test_converted_timm_vit_is_token_major_on_cuda_in_bf16():
    _check_converted_timm_vit("cuda", torch.bfloat16)
