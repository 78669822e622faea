"""Does a ViT with an fp8 patch embed train as its bf16 twin does? A CPU proxy of
bench/probes/fp8_embeds.py's training run, small enough for a 2-core machine.

The fp8 run goes through the same code as on CUDA (core.float8's private switch lets
the run take the CPU, where torch._scaled_mm exists). Three runs of a small timm ViT on
the probe's synthetic 10-class data, same seed and batches: bf16 patch embed, fp8 patch
embed, and bf16 again with the first batch's images nudged by 1e-3, which says how far
two runs drift apart on their own. With warm-up and clipping, as ViT recipes train.

    PYTHONPATH=src python3 bench/probes/fp8_training_cpu.py [--steps 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from fp8_embeds import train_loop  # beside this file, in bench/probes

import gemmconv
from gemmconv.core import float8 as core_float8

IMAGE, PATCH, CLASSES = 64, 8, 10


def batches(steps: int, batch: int):
    """10 classes, each a fixed random 8x8 colour image upsampled, plus noise."""
    g = torch.Generator().manual_seed(0)
    prototypes = F.interpolate(torch.rand(CLASSES, 3, 8, 8, generator=g), size=IMAGE,
                               mode="bilinear")  # fmt: skip
    for _ in range(steps):
        labels = torch.randint(0, CLASSES, (batch,), generator=g)
        images = prototypes[labels] + 0.5 * torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
        yield images, labels


def train(fp8, steps: int, batch: int, nudge: float = 0.0) -> list[float]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=IMAGE, patch_size=PATCH,
                              depth=6, num_classes=CLASSES)  # fmt: skip
    gemmconv.convert(model, include="patch_embed.proj", fp8=fp8)
    losses = train_loop(model, batches(steps, batch), steps, "cpu", 1e-3, nudge)
    if fp8:
        images = next(batches(1, 1))[0]
        note = model.patch_embed.proj.solvers(images).notes[-1]
        assert "runs all three directions" in note, note
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", help="write the three loss curves here")
    args = parser.parse_args()
    core_float8._RUN_ON_CPU_FOR_TESTS = True
    runs = {}
    for name, fp8, nudge in (("bf16", False, 0.0), ("fp8", True, 0.0),
                             ("bf16_nudged", False, 1e-3)):  # fmt: skip
        start = time.perf_counter()
        runs[name] = train(fp8, args.steps, args.batch, nudge)
        tail = sum(runs[name][-20:]) / 20
        print(f"{name}: last-20 mean loss {tail:.4f} ({time.perf_counter() - start:.0f} s)",
              flush=True)  # fmt: skip
    tails = {name: sum(losses[-20:]) / 20 for name, losses in runs.items()}
    print(f"fp8 / bf16 {tails['fp8'] / tails['bf16']:.4f}; "
          f"bf16 nudged / bf16 {tails['bf16_nudged'] / tails['bf16']:.4f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "steps": args.steps, "batch": args.batch,
                       "last_20_mean": tails, "losses": runs}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
