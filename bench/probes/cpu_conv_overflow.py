"""Which CPU convolutions write past the end of a buffer: torch's own calls against
gemmconv's, under tests/native/guard_allocator.c (a write past a tensor buffer's end
faults at the write).

Per class of random problems (1-D, 2-D and 3-D; up to 24 channels, 14 pixels a side,
8 samples), the same problems run through torch's convolution_backward (the weight
gradient, or dx and dW together) and through gemmconv's public call (forward and
backward), each in worker processes under the allocator; a worker that faults is
restarted after the faulting problem. Prints, per class and caller, how many problems
faulted, and the first few of torch's.

    PYTHONPATH=src python3 bench/probes/cpu_conv_overflow.py [--problems 3000]
        [--threads 2] [--seed 21] [--classes strided_1x1_cl_fp32 ...] [--callers torch]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GUARD_SOURCE = Path(__file__).resolve().parents[2] / "tests" / "native" / "guard_allocator.c"

# name -> (dtype, channels-last operands, 1x1 kernels, strides above 1 allowed)
CLASSES = {
    "strided_1x1_cl_bf16": ("bf16", True, True, True),
    "strided_1x1_cl_fp32": ("fp32", True, True, True),
    "strided_1x1_cl_fp16": ("fp16", True, True, True),
    "unit_1x1_cl_bf16": ("bf16", True, True, False),
    "unit_1x1_cl_fp32": ("fp32", True, True, False),
    "strided_1x1_cf_bf16": ("bf16", False, True, True),
    "strided_1x1_cf_fp32": ("fp32", False, True, True),
    "general_cl_bf16": ("bf16", True, False, True),
    "general_cl_fp32": ("fp32", True, False, True),
}

_WORKER = r"""
import json, sys, torch
problems = json.load(open(sys.argv[1])); start = int(sys.argv[2]); caller = sys.argv[3]
torch.set_num_threads(int(sys.argv[4]))
import gemmconv
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
CONVS = {1: gemmconv.conv1d, 2: gemmconv.conv2d, 3: gemmconv.conv3d}
def laid_out(t, last):
    if not last:
        return t.contiguous()
    order = (0, *range(2, t.dim()), 1)
    return t.permute(order).contiguous().permute(0, t.dim() - 1, *range(1, t.dim() - 1))
for i in range(start, len(problems)):
    p = problems[i]
    print(i, flush=True)
    d, dtype = len(p["size"]), DTYPES[p["dtype"]]
    x = laid_out(torch.rand(p["n"], p["c"], *p["size"], dtype=dtype), p["last"])
    w = laid_out(torch.rand(p["k"], p["c"], *p["kernel"], dtype=dtype), p["last"] and p["w_last"])
    if caller == "torch":
        sizes = zip(p["size"], p["padding"], p["kernel"], p["stride"])
        out = [(s + 2 * q - r) // t + 1 for s, q, r, t in sizes]
        dy = laid_out(torch.rand(p["n"], p["k"], *out, dtype=dtype), p["last"])
        torch.ops.aten.convolution_backward.default(dy, x, w, None, p["stride"], p["padding"],
            [1] * d, False, [0] * d, 1, [p["need_dx"], True, False])
    else:
        x.requires_grad_(p["need_dx"]); w.requires_grad_()
        y = CONVS[d](x, w, None, p["stride"], p["padding"])
        y.backward(torch.rand_like(y))
print("end", flush=True)
"""


def problems_of(name: str, count: int, rng: random.Random) -> list[dict]:
    dtype, last, pointwise, strided = CLASSES[name]
    problems = []
    while len(problems) < count:
        d = rng.choice([1, 2, 2, 3])
        size = [rng.randint(1, 14) for _ in range(d)]
        kernel = [1] * d if pointwise else [rng.choice([1, 2, 3]) for _ in range(d)]
        stride = [rng.randint(1, 3) if strided else 1 for _ in range(d)]
        if strided and pointwise and all(s == 1 for s in stride):
            continue
        padding = [0] * d if pointwise else [rng.choice([0, 1]) for _ in range(d)]
        if any(s + 2 * q < r for s, q, r in zip(size, padding, kernel)):
            continue
        problems.append({"dtype": dtype, "last": last, "w_last": rng.random() < 0.3,
                         "n": rng.randint(1, 8), "c": rng.randint(1, 24), "k": rng.randint(1, 24),
                         "size": size, "kernel": kernel, "stride": stride, "padding": padding,
                         "need_dx": rng.random() < 0.5})  # fmt: skip
    return problems


def faults(problems: list[dict], caller: str, guard: Path, threads: int, work: Path) -> list[int]:
    """Indices of the problems whose run faulted under the allocator."""
    path = work / "problems.json"
    path.write_text(json.dumps(problems))
    script = work / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, LD_PRELOAD=str(guard), GUARD_READ="1", OMP_NUM_THREADS=str(threads))
    found, start = [], 0
    while start < len(problems):
        done = subprocess.run([sys.executable, str(script), str(path), str(start), caller,
                               str(threads)], env=env, capture_output=True, text=True)  # fmt: skip
        if done.returncode == 0:
            break
        reached = [int(line) for line in done.stdout.split() if line.isdigit()]
        if not reached:
            raise RuntimeError(f"the worker failed before its first problem: {done.stderr[-800:]}")
        found.append(reached[-1])
        start = reached[-1] + 1
    return found


def build_guard(work: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) to build the guard allocator")
    library = work / "guard_allocator.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(GUARD_SOURCE),
                    "-lpthread"], check=True)  # fmt: skip
    return library


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=3000, help="random problems per class")
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--classes", nargs="+", choices=sorted(CLASSES), default=list(CLASSES))
    parser.add_argument("--callers", nargs="+", choices=("torch", "gemmconv"),
                        default=["torch", "gemmconv"])  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    print(f"# torch {torch.__version__}, {args.threads} threads, {args.problems} problems a "
          f"class, seed {args.seed}")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        guard = build_guard(work)
        for name in args.classes:
            problems = problems_of(name, args.problems, random.Random(f"{args.seed}-{name}"))
            for caller in args.callers:
                found = faults(problems, caller, guard, args.threads, work)
                print(f"{name} {caller}: {len(found)} of {len(problems)} faulted", flush=True)
                for i in found[:3]:
                    print(f"    {json.dumps(problems[i])}", flush=True)


if __name__ == "__main__":
    main()
