"""The reshape + F.linear patch embed that serving frameworks write instead of a patch
convolution, as a module that replaces one in a model (the end-to-end benchmark's
``linear`` variant).

A patch convolution (stride == kernel, no padding, unit dilation, groups 1) is one
matrix product: the patches of x as rows [N*L, C*prod(R)] times the flattened weight.
The rows are taken from x by reshape and permute in x's own memory order ((c, r..) for
channels-first x, (r.., c) for channels-last), so the permuted copy is the only copy;
an input that is exactly one patch per sample (Qwen2-VL) is a view. The result is
returned as [N, K, O..] over token-major memory [N, O.., K], the channels-last layout
F.conv* gives for a channels-last weight, so a following ``flatten(2).transpose(1, 2)``
is a view.

The forward is kept to the few tensor operations a framework pays for (no problem
object, no crop unless the input has a remainder) because the benchmarks compare host
time too: it is also the rewrite whose public call gemmconv.bench.call_timing times.
linear_rewrite.py's helpers are the general form, used for device time and checks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def is_patch_conv(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a plain torch Conv1d/2d/3d that one F.linear computes."""
    if type(module) not in _CONVS:
        return False
    padding = module.padding
    no_padding = padding == "valid" or (not isinstance(padding, str) and not any(padding))
    return (
        no_padding
        and module.groups == 1
        and all(d == 1 for d in module.dilation)
        and tuple(module.stride) == tuple(module.kernel_size)
    )


class LinearPatchEmbed(torch.nn.Module):
    """A patch convolution computed as reshape + F.linear; shares ``conv``'s Parameters."""

    def __init__(self, conv: torch.nn.Module):
        super().__init__()
        if not is_patch_conv(conv):
            raise ValueError(
                f"conv={conv!r}: expected a torch Conv1d/2d/3d with stride == kernel_size, "
                "no padding, dilation 1 and groups 1"
            )
        self.weight = conv.weight
        self.bias = conv.bias
        self.kernel = tuple(conv.kernel_size)
        self._orders = patch_orders(len(self.kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_patch_embed(x, self.weight, self.bias, self.kernel, self._orders)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]}, {self.weight.shape[0]}, kernel=stride={self.kernel}"


def patch_orders(dims: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The permutations that put the patches' output axes before their tap axes: of x
    viewed as [N, C, O1, R1, O2, R2, ..] (channels-first) and as [N, O1, R1, O2, R2,
    .., C] (channels-last)."""
    outs, taps = [2 + 2 * i for i in range(dims)], [3 + 2 * i for i in range(dims)]
    first = (0, *outs, 1, *taps)
    last = (0, *(o - 1 for o in outs), *(t - 1 for t in taps), 2 * dims + 1)
    return first, last


def linear_patch_embed(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: tuple[int, ...],
    orders: tuple[tuple[int, ...], tuple[int, ...]],
) -> torch.Tensor:
    """The patch convolution of ``x`` (stride == ``kernel``) as reshape + F.linear, with
    ``orders`` from patch_orders; [N, K, O..] over token-major memory."""
    n, c, *spatial = x.shape
    out = [s // r for s, r in zip(spatial, kernel)]
    if any(o * r != s for o, r, s in zip(out, kernel, spatial)):
        x = x[(slice(None), slice(None), *(slice(0, o * r) for o, r in zip(out, kernel)))]
    one_patch = all(o == 1 for o in out)
    split = [v for o, r in zip(out, kernel) for v in (o, r)]
    k = weight.shape[0]
    if _is_channels_last(x):
        tokens = x.movedim(1, -1)  # a view: [N, S.., C] is x's memory order
        if not one_patch:
            tokens = tokens.reshape(n, *split, c).permute(orders[1])
        weight = weight.movedim(1, -1).reshape(k, -1)
    else:
        tokens = x if one_patch else x.reshape(n, c, *split).permute(orders[0])
        weight = weight.reshape(k, -1)
    rows = tokens.reshape(n * math.prod(out), -1)
    y = F.linear(rows, weight, bias)
    return y.view(n, *out, k).movedim(-1, 1)


def _is_channels_last(x: torch.Tensor) -> bool:
    """Dense channels-last and not also contiguous (ambiguous strides count as first)."""
    return not x.is_contiguous() and x.movedim(1, -1).is_contiguous()


def replace_patch_convs(model: torch.nn.Module) -> list[str]:
    """Replace, in place, every patch convolution in ``model`` by a LinearPatchEmbed
    sharing its Parameters; returns the qualified names replaced."""
    names = [name for name, m in model.named_modules() if name and is_patch_conv(m)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LinearPatchEmbed(getattr(parent, child)))
    return names


__all__ = [
    "LinearPatchEmbed",
    "is_patch_conv",
    "linear_patch_embed",
    "patch_orders",
    "replace_patch_convs",
]
