"""Hugging Face vision towers, built from small configs (nothing is downloaded), converted.

Qwen2-VL's tower embeds patches with a Conv3d whose kernel is the whole flattened patch
(temporal 2 x 14 x 14), SigLIP's with a Conv2d of stride == kernel: both are matrix
products, so convert() swaps them. The converted towers give torch's results.

    python examples/hf_vision_tower.py
"""

import copy

import torch
from transformers import SiglipVisionConfig, SiglipVisionModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

import gemmconv

torch.manual_seed(0)


def converted_matches(model: torch.nn.Module, run) -> None:
    """Convert ``model``, run it and an unconverted copy, and compare outputs and grads."""
    reference = copy.deepcopy(model)
    print(gemmconv.convert(model))
    outputs = [run(net) for net in (model, reference)]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
    for out in outputs:
        out.square().mean().backward()
    named = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, named[name].grad, rtol=1e-3, atol=1e-5)
    print(f"  output {tuple(outputs[0].shape)} and every gradient match torch's\n")


# ---- Qwen2-VL: the processor flattens each 2x14x14 patch of a frame pair to one row ----
qwen = Qwen2VisionTransformerPretrainedModel(
    Qwen2VLVisionConfig(
        depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, spatial_merge_size=2
    )
)
grid = torch.tensor([[1, 4, 4]])  # (t, h, w) in patches for one image: 16 patches
patches = torch.randn(16, 3 * 2 * 14 * 14)  # what Qwen2VLImageProcessor would give


def run_qwen(net):
    out = net(patches, grid_thw=grid)
    # transformers 5 returns a ModelOutput whose pooler_output holds the merged tokens.
    return out.pooler_output if hasattr(out, "pooler_output") else out


converted_matches(qwen, run_qwen)

# ---- SigLIP: a ViT-style tower, 32x32 images in 8x8 patches ----
siglip = SiglipVisionModel(
    SiglipVisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
)
images = torch.randn(2, 3, 32, 32)
converted_matches(siglip, lambda net: net(pixel_values=images).last_hidden_state)
