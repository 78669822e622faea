"""Small, randomly initialised real models (timm, transformers) for the model tests.

Each entry builds the model (no downloads), makes seeded inputs, runs it to one output
tensor, and names the convolutions convert() must swap and the patch-embed module
to compile. Depths are cut to one or two blocks per stage; the convolution shapes are
the models' own:
ViT's 16x16/16 patch embed, ConvNeXt's 4x4/4 stem and 2x2/2 downsamples, ResNet's 1x1
and strided 1x1, Qwen2-VL's (2, 14, 14) Conv3d on flattened patches, VideoMAE's tubelets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]
    run: Callable[..., torch.Tensor]
    must_swap: tuple[str, ...]
    patch_embed: str  # qualified name of the module to compile on its own

    def __str__(self) -> str:
        return self.name


def _uniform(shape, generator) -> torch.Tensor:
    return torch.rand(shape, generator=generator) * 2 - 1


def _timm(name: str, **kwargs) -> Callable[[], torch.nn.Module]:
    def build():
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)

    return build


def _narrow_resnet() -> torch.nn.Module:
    """resnet26's bottlenecks (1x1, 3x3, 1x1 and the strided 1x1 downsample), one block
    per stage and, where timm allows it, a quarter of the width."""
    import inspect

    import timm
    from timm.models.resnet import ResNet

    kwargs = dict(layers=(1, 1, 1, 1))
    if "channels" in inspect.signature(ResNet.__init__).parameters:
        kwargs["channels"] = (16, 32, 64, 128)
    return timm.create_model("resnet26", pretrained=False, **kwargs)


def _images(size: int, channels: int = 3):
    return lambda n, g: (_uniform((n, channels, size, size), g),)


def _call(model, *inputs):
    return model(*inputs)


# ---- transformers -----------------------------------------------------------

QWEN_PATCH = 14
QWEN_TEMPORAL = 2
QWEN_GRID = (1, 4, 4)  # t, h, w in patches: 16 patches, merged 2x2 -> 4 tokens


def _qwen2_vl_vision() -> torch.nn.Module:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    config = Qwen2VLVisionConfig(
        depth=1,
        embed_dim=32,
        hidden_size=32,
        num_heads=2,
        mlp_ratio=2,
        patch_size=QWEN_PATCH,
        temporal_patch_size=QWEN_TEMPORAL,
        spatial_merge_size=2,
    )
    config._attn_implementation = "eager"
    return Qwen2VisionTransformerPretrainedModel(config)


def _qwen2_vl_inputs(n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    t, h, w = QWEN_GRID
    patches = n * t * h * w
    flat = _uniform((patches, 3 * QWEN_TEMPORAL * QWEN_PATCH * QWEN_PATCH), g)
    grid = torch.tensor([list(QWEN_GRID)] * n)
    return flat, grid


def _qwen2_vl_run(model, flat, grid):
    out = model(flat, grid_thw=grid)
    # transformers 5 returns a ModelOutput whose pooler_output is the merged tokens;
    # 4.x returns the merged tokens themselves.
    return out.pooler_output if hasattr(out, "pooler_output") else out


def _videomae() -> torch.nn.Module:
    from transformers import VideoMAEConfig, VideoMAEModel

    config = VideoMAEConfig(
        image_size=32,
        patch_size=16,
        num_frames=4,
        tubelet_size=2,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    config._attn_implementation = "eager"
    return VideoMAEModel(config)


def _videomae_run(model, video):
    return model(video).last_hidden_state


ZOO = [
    ZooModel(
        "timm_vit_tiny",
        _timm("vit_tiny_patch16_224", img_size=32, depth=2),
        _images(32),
        _call,
        ("patch_embed.proj",),
        "patch_embed",
    ),
    ZooModel(
        "timm_convnext_atto",
        _timm("convnext_atto", depths=(1, 1, 1, 1)),
        _images(64),
        _call,
        ("stem.0", "stages.1.downsample.1", "stages.3.downsample.1", "stages.0.blocks.0.mlp.fc1"),
        "stem",
    ),
    ZooModel(
        "timm_resnet26",
        _narrow_resnet,
        _images(64),
        _call,
        ("layer1.0.conv1", "layer1.0.conv3", "layer2.0.downsample.0", "layer4.0.downsample.0"),
        "layer2.0.downsample",
    ),
    ZooModel(
        "qwen2_vl_vision",
        _qwen2_vl_vision,
        _qwen2_vl_inputs,
        _qwen2_vl_run,
        ("patch_embed.proj",),
        "patch_embed",
    ),
    ZooModel(
        "videomae",
        _videomae,
        lambda n, g: (_uniform((n, 4, 3, 32, 32), g),),
        _videomae_run,
        ("embeddings.patch_embeddings.projection",),
        "embeddings.patch_embeddings",
    ),
]


def captured_inputs(model: torch.nn.Module, module_name: str, run, inputs) -> tuple:
    """The positional inputs ``module_name`` receives when ``model`` runs on ``inputs``."""
    seen = []
    handle = model.get_submodule(module_name).register_forward_pre_hook(
        lambda module, args: seen.append(
            tuple(a.detach() if torch.is_tensor(a) else a for a in args)
        )
    )
    try:
        with torch.no_grad():
            run(model, *inputs)
    finally:
        handle.remove()
    return seen[0]
