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
from fp8_embeds import (
    LABEL_NOISE,
    NOISE,
    label_entropy,
    synthetic_batches,
    train_loop,
)  # beside this file, in bench/probes

import gemmconv
from gemmconv.core import float8 as core_float8

IMAGE, PATCH, CLASSES = 64, 8, 10


def train(
    fp8, steps: int, batch: int, noise: float, label_noise: float, nudge: float = 0.0
) -> list[float]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=IMAGE, patch_size=PATCH,
                              depth=6, num_classes=CLASSES)  # fmt: skip
    gemmconv.convert(model, include="patch_embed.proj", fp8=fp8)
    data = synthetic_batches(steps, batch, IMAGE, noise=noise, label_noise=label_noise)
    losses = train_loop(model, data, steps, "cpu", 1e-3, nudge)
    if fp8:
        images = next(synthetic_batches(1, 1, IMAGE))[0]
        note = model.patch_embed.proj.solvers(images).notes[-1]
        assert "runs all three directions" in note, note
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--noise", type=float, default=NOISE, help="pixel noise std")
    parser.add_argument("--label-noise", type=float, default=LABEL_NOISE,
                        help="share of labels drawn at random")  # fmt: skip
    parser.add_argument("--scaling", nargs="+", default=["tensorwise", "rowwise"],
                        choices=("tensorwise", "rowwise"), help="fp8 runs' scalings")  # fmt: skip
    parser.add_argument("--json", help="write the loss curves here")
    args = parser.parse_args()
    core_float8._RUN_ON_CPU_FOR_TESTS = True
    plan = [("bf16", False, 0.0)]
    plan += [(f"fp8_{s}", gemmconv.Float8Config(scaling=s), 0.0) for s in args.scaling]
    plan.append(("bf16_nudged", False, 1e-3))
    runs, window = {}, min(20, args.steps)
    for name, fp8, nudge in plan:
        start = time.perf_counter()
        runs[name] = train(fp8, args.steps, args.batch, args.noise, args.label_noise, nudge)
        tail = sum(runs[name][-window:]) / window
        print(f"{name}: last-{window} mean loss {tail:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    tails = {name: sum(losses[-window:]) / window for name, losses in runs.items()}
    print(f"the labels' entropy (the lowest loss): {label_entropy(args.label_noise):.4f}")
    print("; ".join(f"{n} / bf16 {t / tails['bf16']:.4f}" for n, t in tails.items() if n != "bf16"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "steps": args.steps, "batch": args.batch,
                       "noise": args.noise, "label_noise": args.label_noise,
                       f"last_{window}_mean": tails, "losses": runs}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
