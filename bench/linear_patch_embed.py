"""The reshape + linear rewrite of a ViT patch embedding, as a module for whole models.

Serving frameworks replace a patch embed's Conv2d (stride == kernel, no padding) by
cutting the image into patches with reshape/permute and applying one F.linear. This
module does that with the convolution's own Parameters, so a state_dict saved from the
torch model loads into the rewritten one and back, and an optimizer sees the same
shapes. Its output is the [N, K, h, w] tensor the convolution returns, laid out
token-major ([N, h, w, K] memory): timm's ``flatten(2).transpose(1, 2)`` is then a
view, as it is after a channels-last convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LinearPatchProjection(torch.nn.Module):
    """A 2-D patch convolution (stride == kernel, no padding, groups 1) as one F.linear."""

    def __init__(self, conv: torch.nn.Conv2d):
        super().__init__()
        problems = _why_not_a_patch_conv(conv)
        if problems:
            raise ValueError(
                f"conv={conv!r}: {'; '.join(problems)}; expected a Conv2d with stride == "
                "kernel_size, padding 0, dilation 1, groups 1 and padding_mode 'zeros'"
            )
        self.in_channels = conv.in_channels
        self.out_channels = conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        # The same Parameter objects: state_dict keys, shapes and optimizer state carry over.
        self.weight = conv.weight
        self.bias = conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, height, width = x.shape
        kh, kw = self.kernel_size
        h, w = height // kh, width // kw
        # Like the convolution, ignore the rows and columns no whole patch covers.
        patches = (
            x[:, :, : h * kh, : w * kw]
            .reshape(n, c, h, kh, w, kw)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(n * h * w, c * kh * kw)
        )
        tokens = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return tokens.view(n, h, w, self.out_channels).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"bias={self.bias is not None}"
        )


def _why_not_a_patch_conv(conv: torch.nn.Module) -> list[str]:
    if type(conv) is not torch.nn.Conv2d:
        return [f"type {type(conv).__name__} is not torch.nn.Conv2d"]
    problems = []
    if tuple(conv.stride) != tuple(conv.kernel_size):
        problems.append(f"stride {tuple(conv.stride)} != kernel_size {tuple(conv.kernel_size)}")
    if conv.padding not in ("valid", (0, 0)):
        problems.append(f"padding={conv.padding!r}")
    if tuple(conv.dilation) != (1, 1):
        problems.append(f"dilation={tuple(conv.dilation)}")
    if conv.groups != 1:
        problems.append(f"groups={conv.groups}")
    if conv.padding_mode != "zeros":
        problems.append(f"padding_mode={conv.padding_mode!r}")
    return problems


def use_linear_patch_embed(model: torch.nn.Module) -> str:
    """Replace ``model.patch_embed.proj`` (timm's ViT layout) by the rewrite, in place;
    returns the qualified name of the replaced module."""
    patch_embed = getattr(model, "patch_embed", None)
    conv = getattr(patch_embed, "proj", None)
    if conv is None:
        raise ValueError(
            f"model={type(model).__name__}: no patch_embed.proj; expected a timm "
            "VisionTransformer-style model whose patch embed is a Conv2d at patch_embed.proj"
        )
    patch_embed.proj = LinearPatchProjection(conv)
    return "patch_embed.proj"
