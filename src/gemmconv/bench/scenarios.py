"""The end-to-end benchmark's scenarios: which model, which step, and its variants.

A scenario is a real model (timm's ViT-B/16 and ConvNeXt-T, transformers' Qwen2-VL
vision tower or its patch embed; random weights, nothing downloaded) and one kind of
step on it: a training step (bf16 autocast, cross entropy on random labels, AdamW,
fused on CUDA, ``zero_grad(set_to_none=True)``), an inference step (bf16 weights,
torch.inference_mode), or a patch embed's forward or forward+backward. Eager, under
torch.compile, or under torch.compile's CUDA graphs ("reduce-overhead").

Each variant starts from a copy of the same randomly initialised model:
- ``torch``:                     as built;
- ``converted``:                 gemmconv.convert(model);
- ``converted_channels_last``:   gemmconv.convert(model, memory_format=torch.channels_last);
- ``linear``:                    every patch convolution replaced by the reshape + F.linear
                                 patch embed serving frameworks write (LinearPatchEmbed);
                                 absent where the model has no patch convolution.

``--quick`` configurations keep each model's structure (patch sizes, kinds of layer) at
sizes a CPU steps through in milliseconds.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.bench.linear_patch_embed import replace_patch_convs
from gemmconv.bench.suite import quick_name, select_named

VARIANTS = ("torch", "converted", "converted_channels_last", "linear")

QWEN_PATCH = 14
QWEN_TEMPORAL = 2
QWEN_PATCH_FEATURES = 3 * QWEN_TEMPORAL * QWEN_PATCH * QWEN_PATCH  # 1176 values per patch


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    model: str  # a key of MODELS
    step: str  # "train", "infer", "fwd" or "fwd_bwd"
    batch: int  # images, or patches for the Qwen2-VL models
    quick_batch: int
    compile_mode: str | None = None  # None: eager; "default" or "reduce-overhead"
    channels_last: bool = False  # model and input in channels-last memory
    # Timed steps per variant as a multiple of the run's --steps. A patch embed's step,
    # 0.1-0.6 ms from an idle device, spread by about half its median between its
    # quartiles on the H200 (bench/NOTES.md), so 20 steps leave its median to chance.
    steps_multiple: int = 1

    @property
    def cuda_only(self) -> bool:
        return self.compile_mode is not None

    def shown_name(self, quick: bool) -> str:
        """The name its rows carry: a quick run names the tiny model and batch it runs
        (``tiny_vit_b16_train_b2``), never the full-size batch."""
        return quick_name(self.name, self.batch, self.quick_batch) if quick else self.name

    def shown_title(self, quick: bool) -> str:
        if not quick:
            return self.title
        return f"as {self.name} ({self.title}) with a tiny model, batch {self.quick_batch}"


# In run order: the eager scenarios first, the compiled ones (minutes of compilation)
# last, so a time budget cuts those first.
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("vit_b16_train_b256", "timm ViT-B/16 train step, batch 256", "vit_b16", "train",
             256, 2),
    Scenario("vit_b16_infer_b1", "timm ViT-B/16 inference, batch 1", "vit_b16", "infer", 1, 1),
    Scenario("vit_b16_infer_b32", "timm ViT-B/16 inference, batch 32", "vit_b16", "infer", 32, 2),
    Scenario("vit_b16_infer_b256", "timm ViT-B/16 inference, batch 256", "vit_b16", "infer",
             256, 4),
    Scenario("qwen2vl_patch_embed_fwd", "Qwen2-VL patch embed forward, 8192 patches",
             "qwen2vl_patch_embed", "fwd", 8192, 64, steps_multiple=10),
    Scenario("qwen2vl_patch_embed_fwd_bwd",
             "Qwen2-VL patch embed forward+backward (weight gradient), 8192 patches",
             "qwen2vl_patch_embed", "fwd_bwd", 8192, 64, steps_multiple=10),
    Scenario("convnext_tiny_train_b128_cl", "timm ConvNeXt-T train step, batch 128, "
             "channels_last", "convnext_tiny", "train", 128, 2, channels_last=True),
    Scenario("qwen2vl_vision_infer_8192", "Qwen2-VL vision tower inference, 8192 patches",
             "qwen2vl_vision", "infer", 8192, 32),
    Scenario("vit_b16_train_b256_compiled", "timm ViT-B/16 train step, batch 256, "
             "torch.compile", "vit_b16", "train", 256, 2, compile_mode="default"),
    Scenario("vit_b16_infer_b8_cudagraphs", "timm ViT-B/16 inference, batch 8, "
             "torch.compile reduce-overhead (CUDA graphs)", "vit_b16", "infer", 8, 2,
             compile_mode="reduce-overhead"),
)  # fmt: skip


def scenarios(names: list[str] | None = None, quick: bool = False) -> list[Scenario]:
    """The scenarios called ``names``; a quick run knows each by its quick name too."""
    if quick and names:
        full = {s.shown_name(True): s.name for s in SCENARIOS}
        names = [full.get(n, n) for n in names]
    return select_named(SCENARIOS, names, "scenarios")


# ---- models ------------------------------------------------------------------------


def _vit_b16(quick: bool) -> torch.nn.Module:
    import timm

    if quick:
        return timm.create_model(
            "vit_base_patch16_224",
            pretrained=False,
            img_size=32,
            depth=1,
            embed_dim=32,
            num_heads=2,
            num_classes=10,
        )
    return timm.create_model("vit_base_patch16_224", pretrained=False)


def _convnext_tiny(quick: bool) -> torch.nn.Module:
    import timm

    if quick:
        return timm.create_model(
            "convnext_tiny",
            pretrained=False,
            depths=(1, 1, 1, 1),
            dims=(8, 16, 32, 64),
            num_classes=10,
        )
    return timm.create_model("convnext_tiny", pretrained=False)


def _qwen2vl_vision_config(quick: bool):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    if quick:
        config = Qwen2VLVisionConfig(
            depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2
        )
    else:
        config = Qwen2VLVisionConfig()  # the released models' tower: depth 32, width 1280
    config._attn_implementation = "sdpa"
    return config


def _qwen2vl_patch_embed(quick: bool) -> torch.nn.Module:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

    config = _qwen2vl_vision_config(quick)
    return PatchEmbed(
        config.patch_size, config.temporal_patch_size, config.in_channels, config.embed_dim
    )


def _qwen2vl_vision(quick: bool) -> torch.nn.Module:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    return Qwen2VisionTransformerPretrainedModel(_qwen2vl_vision_config(quick))


MODELS: dict[str, Callable[[bool], torch.nn.Module]] = {
    "vit_b16": _vit_b16,
    "convnext_tiny": _convnext_tiny,
    "qwen2vl_patch_embed": _qwen2vl_patch_embed,
    "qwen2vl_vision": _qwen2vl_vision,
}
IMAGE_SIZE = {"vit_b16": (224, 32), "convnext_tiny": (224, 32)}  # (full, quick)


def qwen_grid(patches: int) -> tuple[int, int, int]:
    """(t, h, w) in patches for one image of ``patches`` patches, h and w even (the
    tower merges 2x2 patches into a token) and w = 2h where that fits: 8192 -> 1x64x128."""
    h = 2
    while patches % (2 * h) == 0 and 2 * (2 * h) ** 2 <= patches:
        h *= 2
    w = patches // h
    if h * w != patches or w % 2:
        raise ValueError(f"patches={patches}: expected a product of two even numbers")
    return 1, h, w


# ---- variants ----------------------------------------------------------------------


def prepare_variant(
    base: torch.nn.Module, variant: str
) -> tuple[torch.nn.Module, list[str]] | None:
    """A copy of ``base`` made into ``variant``, and the modules it changed; None where
    the variant does not apply (``linear`` on a model without a patch convolution)."""
    model = copy.deepcopy(base)
    if variant == "torch":
        return model, []
    if variant == "converted":
        return model, gemmconv.convert(model).swapped_names
    if variant == "converted_channels_last":
        report = gemmconv.convert(model, memory_format=torch.channels_last)
        return model, report.swapped_names
    if variant == "linear":
        replaced = replace_patch_convs(model)
        return (model, replaced) if replaced else None
    raise ValueError(f"variant={variant!r}: expected one of {', '.join(VARIANTS)}")


# ---- steps -------------------------------------------------------------------------

Step = Callable[[], torch.Tensor]


@dataclasses.dataclass
class Workload:
    """A scenario's base model and its inputs on the device, the same for every variant."""

    model: torch.nn.Module
    inputs: tuple
    labels: torch.Tensor | None = None  # training steps
    grad_output: torch.Tensor | None = None  # the patch embed's backward


def build_workload(s: Scenario, device: torch.device, quick: bool, seed: int = 0) -> Workload:
    """The base model (random weights from ``seed``) and seeded random inputs."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = MODELS[s.model](quick)
    model = model.to(device)
    batch = s.quick_batch if quick else s.batch
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def uniform(*shape, dtype=torch.float32):
        return torch.rand(shape, generator=gen, device=device, dtype=dtype) * 2 - 1

    if s.step == "train":
        model.train()
    else:
        model.eval().to(torch.bfloat16)  # inference and the patch embed run in bf16
    if s.model in IMAGE_SIZE:
        size = IMAGE_SIZE[s.model][1 if quick else 0]
        images = uniform(batch, 3, size, size)
        if s.step != "train":
            images = images.to(torch.bfloat16)
        if s.channels_last:
            model = model.to(memory_format=torch.channels_last)
            images = images.contiguous(memory_format=torch.channels_last)
        labels = None
        if s.step == "train":
            labels = torch.randint(0, model.num_classes, (batch,), generator=gen, device=device)
        return Workload(model, (images,), labels=labels)
    pixels = uniform(batch, QWEN_PATCH_FEATURES, dtype=torch.bfloat16)
    if s.model == "qwen2vl_vision":
        grid = torch.tensor([qwen_grid(batch)], device=device)
        return Workload(model, (pixels, grid))
    dy = uniform(batch, model.embed_dim, dtype=torch.bfloat16)
    return Workload(model, (pixels,), grad_output=dy if s.step == "fwd_bwd" else None)


def make_step(s: Scenario, model: torch.nn.Module, w: Workload, device: torch.device) -> Step:
    """One step of scenario ``s`` on ``model`` (a prepared variant), compiled as the
    scenario says; it returns the step's output (logits, tokens or embeddings)."""
    runner = model if s.compile_mode is None else torch.compile(model, mode=s.compile_mode)
    if s.step == "train":
        kwargs = {"fused": True} if device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **kwargs)
        (images,) = w.inputs

        def train() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = runner(images)
                loss = F.cross_entropy(logits, w.labels)
            loss.backward()
            optimizer.step()
            return logits

        return train
    if s.step == "fwd_bwd":
        (pixels,) = w.inputs

        def forward_backward() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            tokens = runner(pixels)
            tokens.backward(w.grad_output)
            return tokens

        return forward_backward

    graphs = s.compile_mode == "reduce-overhead"

    def infer() -> torch.Tensor:
        if graphs:  # a new step: the previous replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            out = runner(*w.inputs)
        # transformers' vision tower returns the merged tokens as pooler_output
        return out.pooler_output if hasattr(out, "pooler_output") else out

    return infer


__all__ = [
    "SCENARIOS",
    "VARIANTS",
    "Scenario",
    "Workload",
    "build_workload",
    "make_step",
    "prepare_variant",
    "qwen_grid",
    "scenarios",
]
