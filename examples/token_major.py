"""Token-major patch embeddings: the conv writes tokens as rows, the reshape is a view.

A ViT turns the patch embedding's output [N, D, H', W'] into tokens [N, L, D] with
``flatten(2).transpose(1, 2)``. In torch's default layout that transposed tensor is
strided, and the first op that needs it contiguous copies it. A convolution whose weight
is channels-last returns a channels-last output (F.conv2d does the same), which is
[N, H', W', D] in memory: the tokens' own row-major order. convert(...,
memory_format=torch.channels_last) lays the swapped weights out so, in place, and then
the token tensor is a contiguous view of the convolution's output, no copy.

    python examples/token_major.py
"""

import torch

import gemmconv


class PatchEmbed(torch.nn.Module):
    """A ViT's patch embedding: 8x8 patches of a 3-channel image, to 64-wide tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 64, kernel_size=8, stride=8)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # [N, L, D]


torch.manual_seed(0)
embed = PatchEmbed()
images = torch.randn(4, 3, 64, 64)
expected = embed(images)
print("torch, default layout:  tokens contiguous:", expected.is_contiguous())

# Convert, laying the weight out channels-last (do it before the optimizer's first step).
print(gemmconv.convert(embed, memory_format=torch.channels_last))
features = embed.proj(images)  # [4, 64, 8, 8], channels-last in memory
tokens = features.flatten(2).transpose(1, 2)  # [4, 64, 64]: (N, L, D)

print("gemmconv, channels_last: tokens contiguous:", tokens.is_contiguous())
assert features.is_contiguous(memory_format=torch.channels_last)
assert tokens.is_contiguous()
assert tokens.data_ptr() == features.data_ptr()  # a view of the conv's output, not a copy
torch.testing.assert_close(tokens, expected)

# The tokens are rows [N*L, D]; view, not reshape, proves no copy is made.
rows = tokens.view(-1, 64)
print("tokens as rows:", tuple(rows.shape), "sharing the convolution's storage")
