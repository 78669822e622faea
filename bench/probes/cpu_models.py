"""Whole models on the CPU: torch against gemmconv.convert(model), forward (inference) and
training step, at 1 and 2 threads. What the README's "what you get on a CPU" rests on.

    PYTHONPATH=src python3 bench/probes/cpu_models.py [--rounds 3] [--steps 7] [--out FILE]

Both variants live in one process and are timed step by step in turn (the order
alternating every step), so load from other work on the machine falls on both; each
round reports the median step of each and their ratio, and the rounds show how stable
the ratio is. Uses only gemmconv's public API.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import timm
import torch

import gemmconv

# (name, timm model, batch): batches small enough that a training step takes about a
# second on a 2-core CPU.
MODELS = [
    ("ViT-S/16", "vit_small_patch16_224", 4),
    ("ResNet-18", "resnet18", 4),
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def step_fn(model: torch.nn.Module, x: torch.Tensor, train: bool) -> Callable[[], None]:
    if not train:
        model.eval()

        def infer() -> None:
            with torch.inference_mode():
                model(x)

        return infer
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().sum().backward()
        optimizer.step()

    return train_step


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000.0


def measure(steps: dict[str, Callable[[], None]], n: int) -> dict[str, float]:
    """Median ms per step of each variant, timed in turn, the order alternating, and
    the median of the ratios of the pairs of steps timed side by side ("ratio"): load
    from other work that drifts over the round falls on both steps of a pair alike."""
    for fn in steps.values():  # warm-up: first calls decide solvers and allocate
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(n):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(timed(steps[name]))
    medians = {name: statistics.median(t) for name, t in times.items()}
    pairs = [c / t for c, t in zip(times["converted"], times["torch"], strict=True)]
    return {**medians, "ratio": statistics.median(pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=0, help="batch for every model (0: MODELS')")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    header = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "gemmconv": gemmconv.__version__,
        "commit": commit(),
        "load_average_start": os.getloadavg(),
    }
    print(json.dumps(header), flush=True)
    rows = []
    for label, name, batch in MODELS:
        batch = args.batch or batch
        torch.manual_seed(0)
        reference = timm.create_model(name, pretrained=False)
        converted = copy.deepcopy(reference)
        report = gemmconv.convert(converted)
        print(report, flush=True)
        x = torch.randn(batch, 3, 224, 224)
        for train in (False, True):
            what = "training step" if train else "forward (inference)"
            steps = {
                "torch": step_fn(reference, x, train),
                "converted": step_fn(converted, x, train),
            }
            for n_threads in threads:
                torch.set_num_threads(n_threads)
                for r in range(args.rounds):
                    med = measure(steps, args.steps)
                    row = {
                        "model": label,
                        "batch": batch,
                        "call": what,
                        "threads": n_threads,
                        "round": r,
                        "torch_ms": round(med["torch"], 2),
                        "converted_ms": round(med["converted"], 2),
                        "converted_over_torch": round(med["ratio"], 3),
                        "load_average": os.getloadavg()[0],
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    header["load_average_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    print(json.dumps({"load_average_end": header["load_average_end"]}), flush=True)


if __name__ == "__main__":
    main()
