"""The fp8 patch embed on a GPU: its speed through the public call, and a training run.

(a) Per fp8 case of the suite (gemmconv.bench.fp8_rows: Qwen2-VL's Conv3d embed at
    8192 patches, ViT-B/16 at batch 256; bf16, channels-first input): the suite's fp8
    row (gemmconv fp8, gemmconv bf16, torch's convolution and the reshape + linear
    rewrite, forward+backward in a steady stream of public calls); the same four
    modules under torch.compile; and one profiled step of gemmconv fp8 and bf16, its
    device time split into GEMM kernels and the rest (a diagnostic).
(b) 300 steps of timm's vit_small_patch16_224 on synthetic CIFAR-like data at 224
    (10 classes, each a fixed random low-frequency image plus noise, a share of the
    labels random; same seed), bf16 autocast, AdamW with warm-up, cosine and clipping,
    with the patch embed in bf16, in fp8 (a run per ``--scaling``), and in bf16 again with the
    first batch nudged by 1e-3 (how far two runs drift on their own): the loss curves,
    the final losses as the mean of the last 20 steps and their ratios (target: fp8
    within 1% of bf16), as JSON and, where matplotlib is installed, a PNG figure.

Each result line is printed and appended to DIR/fp8_embeds.jsonl as it finishes;
``--json PATH`` also writes the timing rows as one JSON document at the end.

    PYTHONPATH=src python3 bench/probes/fp8_embeds.py --out DIR [--steps 300] [--reps 30]
        [--scaling tensorwise rowwise] [--skip-training] [--skip-timing] [--skip-compiled]
        [--json PATH]
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--json", type=Path, default=None, help="the timing rows as JSON here")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per variant")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--batch", type=int, default=64, help="training batch size")
    parser.add_argument("--scaling", nargs="+", choices=("tensorwise", "rowwise"),
                        default=["tensorwise", "rowwise"],
                        help="a run per fp8 scaling (Float8Config.scaling)")  # fmt: skip
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the timing "
                        "code (with the fp8 run let onto the CPU)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="the suite's tiny shapes")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-compiled", action="store_true",
                        help="leave out the torch.compile timings (eight compiles)")  # fmt: skip
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


def _cases():
    from gemmconv.bench.fp8_rows import CASES
    from gemmconv.bench.suite import suite_cases

    return suite_cases(CASES)


def time_rows(args, log: Log) -> list[dict]:
    """Per case: the suite's fp8 row (eager, a steady stream of public calls), the same
    four modules under torch.compile, and one profiled step of each gemmconv variant
    split into GEMM and other kernels (device time: a diagnostic)."""
    from gemmconv.bench.call_timing import _interleaved_twice
    from gemmconv.bench.fp8_rows import VARIANTS, _modules, _step, fp8_row

    device, rows = torch.device(args.device), []
    for case in _cases():
        eager = fp8_row(case, device, args.quick, args.reps, None)
        record = {"case": case.name, "mode": "eager", **eager, **_where()}
        rows.append(record)
        log(f"{case.name} eager: {_times_text(eager)}", record)
        if not eager.get("applies"):
            continue
        shape = case.tiny if args.quick else case.full
        modules = _modules(shape, len(shape.kernel), device)
        x = torch.randn(shape.n, shape.c, *shape.spatial, device=device,
                        dtype=torch.bfloat16, requires_grad=True)  # fmt: skip
        with torch.no_grad():
            dy = torch.randn_like(modules["torch"](x))
        for name in ("gemmconv fp8", "gemmconv bf16"):
            split = device_split(_step(modules[name], x, dy))
            split.update(host_split(_step(modules[name], x, dy)))
            record = {"case": case.name, "mode": "device split", "variant": name, **split}
            rows.append(record)
            log(
                f"{case.name} {name} device time: "
                + ", ".join(f"{k} {v:.1f} us" for k, v in split.items() if k.endswith("_us"))
                + "; most host time in: "
                + "; ".join(f"{n} {us} us x{calls}" for n, us, calls in split["own_time"][:6]),
                record,
            )
        if args.skip_compiled:
            continue
        compiled = {n: [_step(torch.compile(modules[n]), x, dy)] for n in VARIANTS}
        times = _interleaved_twice(compiled, device, args.reps, 3, None, {})
        ms = {n: times[n].median_ms for n in VARIANTS}
        record = {"case": case.name, "mode": "torch.compile", "applies": True, "ms": ms,
                  "fp8_speedup": ms["gemmconv bf16"] / ms["gemmconv fp8"], **_where()}  # fmt: skip
        rows.append(record)
        log(f"{case.name} compiled: {_times_text(record)}", record)
    return rows


def _where() -> dict:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": name, "torch": torch.__version__}


def _times_text(row: dict) -> str:
    if not row.get("applies"):
        return f"not run: {row.get('note')}"
    ms = row["ms"]
    return ", ".join(f"{n} {v:.4f}" for n, v in ms.items()) + (
        f" ms; fp8 x{row['fp8_speedup']:.2f} over bf16"
    )


def device_split(call) -> dict:
    """Device time of one ``call`` (after two warm ones), in microseconds: its GEMM
    kernels (cuBLAS, cuBLASLt's fp8, gemmconv's Triton GEMMs) and the rest (amax,
    scales, casts, copies), with the rest's three largest kernels named."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        call()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    gemm, other, kernels = 0.0, 0.0, {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time
        name = event.name
        if any(tag in name.lower() for tag in ("gemm", "sm90", "cutlass", "_gemm_", "matmul")):
            gemm += us
        else:
            other += us
            kernels[name[:60]] = kernels.get(name[:60], 0.0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:3]
    return {"gemm_us": gemm, "other_us": other, "total_us": gemm + other,
            "largest_other": [[n, round(us, 1)] for n, us in top]}  # fmt: skip


def host_split(call, steps: int = 30, top: int = 24) -> dict:
    """Host time of ``call`` (after two warm ones), in microseconds: the median time to
    issue one call (the device left running), and the functions with the most own time
    under cProfile over ``steps`` calls, per call, the backward run on the calling
    thread so that it shows. A diagnostic: where the eager fp8
    step's host time goes, which its device time (device_split) does not explain."""
    import cProfile
    import pstats
    import statistics

    cuda = torch.cuda.is_available()
    for _ in range(2):
        call()
    issue = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        issue.append((time.perf_counter() - start) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    # The backward kept on the calling thread, where cProfile sees it.
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(steps):
            call()
        profiler.disable()
    if cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "issue_us": statistics.median(issue),
        "own_time": [
            [f"{Path(f).name}:{line}({name})", round(tt / steps * 1e6, 1), nc // steps]
            for (f, line, name), (_, nc, tt, _, _) in ranked
        ],
    }


# ---- (b) training --------------------------------------------------------------


# The data's difficulty. With pixel noise 0.5 and clean labels a ViT-S/16 drove the
# loss towards zero by step 300, where a ratio of final losses magnifies any drift: a
# 1e-3 nudge of the first batch moved the CPU proxy's final loss by 29%. With a share
# of labels drawn at random the loss settles at the labels' own entropy, which every
# run that learned the classes reaches alike.
NOISE = 0.5
LABEL_NOISE = 0.3


def synthetic_batches(steps: int, batch: int, image: int = 224, seed: int = 0,
                      noise: float = NOISE, label_noise: float = LABEL_NOISE):  # fmt: skip
    """CIFAR-like data: 10 classes, each a fixed random 8x8 colour image upsampled to
    ``image``, plus Gaussian noise of std ``noise``, each label replaced by a random one
    with probability ``label_noise``; the same sequence for every run. Shared with
    bench/probes/fp8_training_cpu.py."""
    g = torch.Generator().manual_seed(seed)
    prototypes = F.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=image,
                               mode="bilinear")  # fmt: skip
    for _ in range(steps):
        labels = torch.randint(0, 10, (batch,), generator=g)
        images = prototypes[labels] + noise * torch.randn(batch, 3, image, image, generator=g)
        swapped = torch.rand(batch, generator=g) < label_noise
        labels = torch.where(swapped, torch.randint(0, 10, (batch,), generator=g), labels)
        yield images, labels


def label_entropy(label_noise: float, classes: int = 10) -> float:
    """The lowest mean cross-entropy any model can reach on such labels (nats)."""
    import math

    right = 1 - label_noise + label_noise / classes
    wrong = label_noise / classes
    return -(right * math.log(right) + (classes - 1) * wrong * math.log(wrong))


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
    runs = [("bf16", False, 0.0)]
    runs += [(f"fp8_{s}", gemmconv.Float8Config(scaling=s), 0.0) for s in args.scaling]
    runs.append(("bf16_nudged", False, 1e-3))
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
    over_bf16 = {k: v / final["bf16"] for k, v in final.items() if k != "bf16"}
    result = {
        "model": "vit_small_patch16_224",
        "steps": args.steps,
        "batch": args.batch,
        "final_loss_mean_last": window,
        "final_loss": final,
        "over_bf16": over_bf16,
        "within_1_percent": {k: abs(r - 1) <= 0.01 for k, r in over_bf16.items()},
        "label_noise": LABEL_NOISE,
        "label_entropy": label_entropy(LABEL_NOISE),
        "losses": curves,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    (args.out / "fp8_training.json").write_text(json.dumps(result, indent=1))
    log(
        f"final loss (mean of last {window}; the labels' entropy "
        f"{result['label_entropy']:.4f}): "
        + ", ".join(f"{k} {v:.4f}" for k, v in final.items())
        + "; over bf16: "
        + ", ".join(f"{k} {r:.4f}" for k, r in over_bf16.items()),
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
    # A running mean of 10 steps: with random labels a single batch's loss is noisy.
    for name, losses in curves.items():
        smooth = [statistics.fmean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=f"{name} patch embed (last-{window} mean {final[name]:.4f})")
    ax.axhline(result["label_entropy"], color="grey", linestyle="--", label="labels' entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy, running mean of 10 steps")
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
    if args.device == "cpu":
        from gemmconv.core import float8 as core_float8

        core_float8._RUN_ON_CPU_FOR_TESTS = True
        if not args.skip_training:
            print("fp8_embeds: --device cpu smoke-runs the timing only", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print("fp8_embeds: needs a CUDA device", file=sys.stderr)
        return 2
    log = Log(args.out)
    rows = [] if args.skip_timing else time_rows(args, log)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if not args.skip_training:
        training_run(args, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
