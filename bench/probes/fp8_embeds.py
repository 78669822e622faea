"""The fp8 patch embed on a GPU: its speed through the public call, and a training run.

(a) Forward + backward (module call, then loss.backward()) of Qwen2-VL's embed
    (Conv3d(3, 1280, (2, 14, 14), stride=(2, 14, 14), bias=False) on [8192, 3, 2, 14,
    14] bf16) and ViT-B/16 at batch 256 (Conv2d(3, 768, 16, 16) on [256, 3, 224, 224]
    bf16), the input and the weight needing gradients, in: gemmconv bf16, gemmconv fp8
    (set_fp8), torch's Conv (cuDNN), and the reshape + F.linear rewrite; each gemmconv
    row also with the weight channels-last (convert(memory_format=...)), which gives
    rows-major y and lets the fp8 GEMM write y in place. Median of interleaved
    repetitions (CUDA events around each call and its backward), with the ratio to
    gemmconv bf16 on the same card.
(b) 300 steps of timm's vit_small_patch16_224 on synthetic CIFAR-like data at 224
    (10 classes, each a fixed random low-frequency image plus noise; same seed), bf16
    autocast, AdamW with warm-up, cosine and clipping, with the patch embed in bf16, in
    fp8 (``--scaling``), and in bf16 again with the first batch nudged by 1e-3 (how far
    two runs drift on their own): the loss curves, the final losses as the mean of the
    last 20 steps and their ratios (target: fp8 within 1% of bf16), as JSON and, where
    matplotlib is installed, a PNG figure.

Each result line is printed and appended to DIR/fp8_embeds.jsonl as it finishes;
``--json PATH`` also writes the timing rows as one JSON document at the end.

    PYTHONPATH=src python3 bench/probes/fp8_embeds.py --out DIR [--steps 300] [--reps 30]
        [--scaling rowwise] [--skip-training] [--skip-timing] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    "qwen2vl_embed_8192": dict(
        cls=torch.nn.Conv3d, c=3, k=1280, kernel=(2, 14, 14), bias=False,
        input=(8192, 3, 2, 14, 14),
    ),
    "vit_b16_b256": dict(
        cls=torch.nn.Conv2d, c=3, k=768, kernel=(16, 16), bias=True, input=(256, 3, 224, 224),
    ),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--json", type=Path, default=None, help="the timing rows as JSON here")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per variant")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--batch", type=int, default=64, help="training batch size")
    parser.add_argument("--scaling", choices=("tensorwise", "rowwise"), default="tensorwise",
                        help="the fp8 run's scaling (Float8Config.scaling)")  # fmt: skip
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args(argv)
    for name in ("reps", "steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: expected a positive integer")
    return args


class Log:
    """Prints each result line and appends it to DIR/fp8_embeds.jsonl at once."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "fp8_embeds.jsonl"

    def __call__(self, text: str, record: dict) -> None:
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


# ---- (a) timing ----------------------------------------------------------------


def _variants(shape: dict):
    """name -> (module, input maker): the same weights in every variant."""
    import gemmconv
    from gemmconv.bench.linear_patch_embed import LinearPatchEmbed

    torch.manual_seed(0)
    base = shape["cls"](shape["c"], shape["k"], shape["kernel"], stride=shape["kernel"],
                        bias=shape["bias"]).cuda().to(torch.bfloat16)  # fmt: skip
    last = torch.channels_last if len(shape["kernel"]) == 2 else torch.channels_last_3d

    def copy(convert=None, fp8=False, weight_last=False):
        m = shape["cls"](shape["c"], shape["k"], shape["kernel"], stride=shape["kernel"],
                         bias=shape["bias"]).cuda().to(torch.bfloat16)  # fmt: skip
        m.load_state_dict(base.state_dict())
        if convert == "gemmconv":
            gemmconv.convert(m, fp8=fp8, memory_format=last if weight_last else None)
        elif convert == "rewrite":
            m = LinearPatchEmbed(m)
        return m

    return {
        "torch (cuDNN)": copy(),
        "reshape+linear": copy("rewrite"),
        "gemmconv bf16": copy("gemmconv"),
        "gemmconv fp8": copy("gemmconv", fp8=True),
        "gemmconv bf16, weight channels-last": copy("gemmconv", weight_last=True),
        "gemmconv fp8, weight channels-last": copy("gemmconv", fp8=True, weight_last=True),
    }


def _step(module, x, dy):
    y = module(x)
    y.backward(dy)


def time_shapes(args, log: Log) -> list[dict]:
    rows = []
    for name, shape in SHAPES.items():
        variants = _variants(shape)
        x = torch.randn(shape["input"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with torch.no_grad():
            dy = torch.randn_like(next(iter(variants.values()))(x))
        for module in variants.values():  # warm: plans, cuBLASLt heuristics
            for _ in range(3):
                _step(module, x, dy)
        fp8_module = variants["gemmconv fp8"]
        note = fp8_module.solvers(x).notes[-1]
        log(f"{name}: {note}", {"shape": name, "fp8_note": note})
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.reps):
            for variant, module in variants.items():  # interleaved
                x.grad = None
                for p in module.parameters():
                    p.grad = None
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                torch.cuda.synchronize()
                start.record()
                _step(module, x, dy)
                end.record()
                end.synchronize()
                times[variant].append(start.elapsed_time(end))
        base = statistics.median(times["gemmconv bf16"])
        base_last = statistics.median(times["gemmconv bf16, weight channels-last"])
        for variant, samples in times.items():
            ms = statistics.median(samples)
            reference = base_last if "channels-last" in variant else base
            row = {
                "shape": name,
                "variant": variant,
                "median_ms": ms,
                "speedup_vs_gemmconv_bf16": reference / ms,
                "reps": args.reps,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
            }
            rows.append(row)
            log(
                f"{name:20s} {variant:38s} {ms:8.3f} ms  x{reference / ms:5.2f} vs gemmconv "
                "bf16" + (" (weight channels-last)" if "channels-last" in variant else ""),
                row,
            )
    return rows


# ---- (b) training --------------------------------------------------------------


def synthetic_batches(steps: int, batch: int, seed: int = 0):
    """CIFAR-like data at 224: 10 classes, each a fixed random 8x8 colour image
    upsampled, plus noise; the same sequence for every run."""
    g = torch.Generator().manual_seed(seed)
    prototypes = F.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=224, mode="bilinear")
    for _ in range(steps):
        labels = torch.randint(0, 10, (batch,), generator=g)
        images = prototypes[labels] + 0.5 * torch.randn(batch, 3, 224, 224, generator=g)
        yield images, labels


def train_loop(model, batches, steps: int, device: str, lr: float, nudge: float = 0.0):
    """Losses of ``steps`` steps of ``model`` on ``batches`` under bf16 autocast: AdamW
    with a linear warm-up over the first tenth of the steps, then cosine, gradients
    clipped to norm 1 (a ViT recipe: without the warm-up both runs sat flat and then
    parted at the same step on an H100, bench/results/fp8_loss_h100.png). ``nudge`` is
    added to the first batch's images: a bf16 run nudged by 1e-3 shows how far two runs
    drift on their own. Shared with bench/probes/fp8_training_cpu.py."""
    import math

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    warmup = max(1, steps // 10)

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    losses = []
    for step, (images, labels) in enumerate(batches):
        if step == 0 and nudge:
            images = images + nudge
        images, labels = images.to(device), labels.to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


def train(fp8, args, nudge: float = 0.0) -> list[float]:
    """Losses of one run: a fresh ViT-S/16 (seed 0), the patch embed converted with
    ``fp8`` (False, or a Float8Config), trained by train_loop."""
    import timm

    import gemmconv

    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", num_classes=10).cuda()
    gemmconv.convert(model, include="patch_embed.proj", fp8=fp8)
    batches = synthetic_batches(args.steps, args.batch)
    losses = train_loop(model, batches, args.steps, "cuda", 3e-4, nudge)
    if fp8:
        note = model.patch_embed.proj.solvers().notes[-1]
        assert "runs all three directions" in note, note
    return losses


def training_run(args, log: Log) -> dict:
    import gemmconv

    curves = {}
    runs = (("bf16", False, 0.0), ("fp8", gemmconv.Float8Config(scaling=args.scaling), 0.0),
            ("bf16_nudged", False, 1e-3))  # fmt: skip
    for name, fp8, nudge in runs:
        start = time.perf_counter()
        curves[name] = train(fp8, args, nudge)
        seconds = time.perf_counter() - start
        log(
            f"training {name} patch embed: {args.steps} steps in {seconds:.1f} s, "
            f"last loss {curves[name][-1]:.4f}",
            {"run": name, "seconds": seconds},
        )
    window = min(20, args.steps)
    final = {k: statistics.fmean(v[-window:]) for k, v in curves.items()}
    ratio = final["fp8"] / final["bf16"]
    result = {
        "model": "vit_small_patch16_224",
        "steps": args.steps,
        "batch": args.batch,
        "final_loss_mean_last": window,
        "final_loss": final,
        "fp8_over_bf16": ratio,
        "bf16_nudged_over_bf16": final["bf16_nudged"] / final["bf16"],
        "scaling": args.scaling,
        "within_1_percent": abs(ratio - 1) <= 0.01,
        "losses": curves,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    (args.out / "fp8_training.json").write_text(json.dumps(result, indent=1))
    log(
        f"final loss (mean of last {window}): bf16 {final['bf16']:.4f}, fp8 {final['fp8']:.4f}, "
        f"ratio {ratio:.4f} ({'within' if result['within_1_percent'] else 'NOT within'} 1%)",
        {k: v for k, v in result.items() if k != "losses"},
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure", flush=True)
        return result
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(losses, label=f"{name} patch embed (last-{window} mean {final[name]:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(
        f"vit_small_patch16_224, bf16 autocast, AdamW, warm-up; {torch.cuda.get_device_name()}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "fp8_training.png", dpi=120)
    print(f"figure: {args.out / 'fp8_training.png'}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_embeds: needs a CUDA device", file=sys.stderr)
        return 2
    log = Log(args.out)
    rows = [] if args.skip_timing else time_shapes(args, log)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.skip_training:
        training_run(args, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
