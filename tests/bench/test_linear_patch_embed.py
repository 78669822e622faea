"""LinearPatchEmbed, the end-to-end benchmark's reshape + F.linear rewrite of a patch
convolution: it computes the convolution (float64 reference, every layout and
dimension, forward and gradients), returns token-major memory, shares the Parameters,
and replace_patch_convs swaps exactly the patch convolutions."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemmconv.bench.linear_patch_embed import LinearPatchEmbed, is_patch_conv, replace_patch_convs
from gemmconv.measuring.verify import rms_range, tolerance

TOL = tolerance(torch.float64, "cpu")
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}

CASES = {
    "patch2d": (torch.nn.Conv2d, dict(kernel_size=4, stride=4), (2, 3, 16, 12)),
    "patch2d_remainder": (torch.nn.Conv2d, dict(kernel_size=4, stride=4), (2, 3, 18, 15)),
    "point3d_qwen": (torch.nn.Conv3d, dict(kernel_size=(2, 6, 6), stride=(2, 6, 6), bias=False),
                     (5, 3, 2, 6, 6)),
    "patch3d": (torch.nn.Conv3d, dict(kernel_size=2, stride=2), (2, 3, 4, 6, 2)),
    "patch1d": (torch.nn.Conv1d, dict(kernel_size=4, stride=4), (2, 3, 16)),
    "pointwise2d": (torch.nn.Conv2d, dict(kernel_size=1), (2, 3, 5, 3)),
}  # fmt: skip


# Every case with each operand channels-first or channels-last (1-D tensors have no
# channels-last format).
LAYOUTS = [
    pytest.param(name, input_cl, weight_cl, id=f"{name}-x_{'cl' if input_cl else 'cf'}-"
                 f"w_{'cl' if weight_cl else 'cf'}")
    for name, (_, _, shape) in CASES.items()
    for input_cl in (False, True)
    for weight_cl in (False, True)
    if len(shape) > 3 or not (input_cl or weight_cl)
]  # fmt: skip


@pytest.mark.parametrize("name, input_cl, weight_cl", LAYOUTS)
def test_computes_the_convolution_and_its_gradients(name, input_cl, weight_cl):
    cls, kwargs, shape = CASES[name]
    torch.manual_seed(0)
    conv = cls(3, 8, **kwargs).double()
    g = torch.Generator().manual_seed(1)
    x = torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1
    if weight_cl:
        conv = conv.to(memory_format=CHANNELS_LAST[len(shape)])
    if input_cl:
        x = x.contiguous(memory_format=CHANNELS_LAST[len(shape)])
    embed = LinearPatchEmbed(conv)
    assert embed.weight is conv.weight and embed.bias is conv.bias
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = embed(x_ours), conv(x_ref)
    assert y.shape == y_ref.shape and rms_range(y, y_ref) <= TOL
    # Token-major: [N, K, O..] over [N, O.., K] memory.
    assert y.movedim(1, -1).is_contiguous()
    dy = torch.rand(y.shape, generator=g, dtype=torch.float64) * 2 - 1
    grads = torch.autograd.grad(y, [x_ours, *conv.parameters()], dy)
    grads_ref = torch.autograd.grad(y_ref, [x_ref, *conv.parameters()], dy)
    for got, want in zip(grads, grads_ref, strict=True):
        assert rms_range(got, want) <= TOL


class _CopyLog(TorchDispatchMode):
    """Counts the aten ops that copy tensor data."""

    COPIES = ("clone", "copy_", "_to_copy", "contiguous")

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.COPIES:
            self.copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "shape, kernel, copies",
    [((5, 3, 2, 6, 6), (2, 6, 6), 0), ((2, 3, 4, 12, 12), (2, 6, 6), 1)],
    ids=["one_patch_per_sample", "patches"],
)
def test_the_permuted_rows_are_the_only_copy(shape, kernel, copies):
    conv = torch.nn.Conv3d(3, 8, kernel_size=kernel, stride=kernel, bias=False)
    embed = LinearPatchEmbed(conv)
    x = torch.rand(shape)
    with torch.no_grad(), _CopyLog() as log:
        y = embed(x)
    assert log.copies == copies
    assert rms_range(y, conv(x).detach()) <= tolerance(torch.float32, "cpu")


def test_refuses_a_convolution_that_is_not_a_patch():
    for conv in (
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.Conv2d(3, 8, 4, stride=2),
        torch.nn.Conv2d(4, 8, 2, stride=2, groups=2),
        torch.nn.ConvTranspose2d(3, 8, 2, stride=2),
    ):
        assert not is_patch_conv(conv)
        with pytest.raises(ValueError, match=r"conv=.*expected a torch Conv1d/2d/3d with stride"):
            LinearPatchEmbed(conv)


def test_replace_patch_convs_swaps_exactly_the_patch_convolutions():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 4, stride=4),
        torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 2, 2)),
    )
    weight = model[1][1].weight
    x = torch.rand(2, 3, 16, 16)
    expected = model(x)
    assert replace_patch_convs(model) == ["0", "1.1"]
    assert isinstance(model[0], LinearPatchEmbed) and isinstance(model[1][1], LinearPatchEmbed)
    assert type(model[1][0]) is torch.nn.Conv2d
    assert model[1][1].weight is weight
    assert rms_range(model(x), expected) <= tolerance(torch.float32, "cpu")
    assert replace_patch_convs(torch.nn.Sequential(torch.nn.Linear(3, 3))) == []


def test_traces_whole_under_torch_compile():
    conv = torch.nn.Conv2d(3, 8, 4, stride=4)
    embed = LinearPatchEmbed(conv)
    compiled = torch.compile(embed, backend="eager", fullgraph=True)
    x = torch.rand(2, 3, 16, 16)
    assert rms_range(compiled(x), conv(x)) <= tolerance(torch.float32, "cpu")
