"""A timm ViT, converted, trained for a few steps on the CPU.

convert() swaps the patch embedding (a Conv2d with stride == kernel) for gemmconv's
module in place; the model, its Parameters and the optimizer are otherwise untouched.
The same steps on an unconverted copy give the same losses (to float rounding).

    python examples/timm_vit_training.py
"""

import copy

import timm
import torch

import gemmconv

torch.manual_seed(0)
# ViT-Tiny's layout at a toy size: 32x32 images in 8x8 patches, two blocks.
model = timm.create_model(
    "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=10
)
reference = copy.deepcopy(model)  # stays on torch's convolution, for comparison

report = gemmconv.convert(model)
print(report)  # what was swapped (patch_embed.proj) and why anything else was not
assert report.swapped_names == ["patch_embed.proj"]

images = torch.randn(16, 3, 32, 32)
labels = torch.randint(0, 10, (16,))
for net in (model, reference):
    net.train()
optimizers = [torch.optim.AdamW(net.parameters(), lr=1e-3) for net in (model, reference)]

for step in range(3):
    losses = []
    for net, optimizer in zip((model, reference), optimizers):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"step {step}: loss {losses[0]:.5f} (torch's convolution: {losses[1]:.5f})")
    # Summation order differs between the GEMM and torch's kernels: close, not bitwise.
    assert abs(losses[0] - losses[1]) < 1e-4 * max(1.0, abs(losses[1]))

# Which solver each direction of the patch embedding runs on this device;
# print(model.patch_embed.proj.solvers(images)) shows the whole table, with reasons.
choices = model.patch_embed.proj.solvers(images)
print({direction: choice.solver for direction, choice in choices.items()})
