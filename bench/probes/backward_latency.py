"""Synchronous forward+backward latency of patch embeds: gemmconv's C++ autograd node,
its Python node, torch's convolution and the reshape + F.linear rewrite.

Each step starts from an idle device and ends synchronised: the gradients are set to
None, the forward runs, ``y.backward(dy)`` runs, the device is synchronised. The
variants run interleaved, each timed step after an untimed one of its own, and the
median wall clock is printed per case as one JSON line. A second column times the
backward alone (forward untimed, then the synchronised backward), the hand-off
through autograd's device thread included. gemmconv's Python node is reached by
hiding the loaded C++ node from the eager road (``native_node.rows_gemm``), so both run
in one process on the same operands.

    PYTHONPATH=src python bench/probes/backward_latency.py --out latency.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import gemmconv
from gemmconv.bench.linear_patch_embed import linear_patch_embed, patch_orders
from gemmconv.measuring.timing import interleaved_orders
from gemmconv.roads import native_node

# name: (input shape, out channels, x needs a gradient)
CASES = {
    "qwen2vl_dx_dw": ((8192, 3, 2, 14, 14), 1280, True),
    "qwen2vl_dw": ((8192, 3, 2, 14, 14), 1280, False),
    "qwen2vl_b1_dw": ((1, 3, 2, 14, 14), 1280, False),
    "vit_b16_b1_dw": ((1, 3, 224, 224), 768, False),
    "vit_b16_b32_dw": ((32, 3, 224, 224), 768, False),
    "vit_b16_b32_dx_dw": ((32, 3, 224, 224), 768, True),
}
VARIANTS = ("torch", "rewrite", "gemmconv_python_node", "gemmconv_cpp_node")
TORCH_CONV = {4: F.conv2d, 5: F.conv3d}
GEMMCONV_CONV = {4: gemmconv.conv2d, 5: gemmconv.conv3d}


def steps_for(shape, k, needs_dx, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    kernel = shape[2:] if len(shape) == 5 else (16, 16)
    x = (torch.rand(shape, generator=gen, device=device) * 2 - 1).to(dtype)
    x.requires_grad_(needs_dx)
    w = (torch.rand((k, 3, *kernel), generator=gen, device=device) * 2 - 1).to(dtype)
    w.requires_grad_()
    b = torch.zeros(k, device=device, dtype=dtype, requires_grad=True)
    orders = patch_orders(len(kernel))
    forward = {
        "torch": lambda: TORCH_CONV[x.dim()](x, w, b, stride=kernel),
        "rewrite": lambda: linear_patch_embed(x, w, b, kernel, orders),
        "gemmconv_python_node": lambda: GEMMCONV_CONV[x.dim()](x, w, b, stride=kernel),
        "gemmconv_cpp_node": lambda: GEMMCONV_CONV[x.dim()](x, w, b, stride=kernel),
    }
    dy = torch.rand(forward["torch"]().shape, generator=gen, device=device).to(dtype)
    return forward, (x, w, b), dy


def timed(variant, forward, tensors, dy, loaded, whole: bool) -> float:
    """One step's wall clock in us: forward and backward (``whole``) or the backward."""
    native_node.rows_gemm = None if variant == "gemmconv_python_node" else loaded
    for t in tensors:
        t.grad = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    y = forward[variant]()
    if not whole:
        torch.cuda.synchronize()
        start = time.perf_counter()
    y.backward(dy)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    assert native_node.build(), native_node.status()
    loaded = native_node.rows_gemm
    for name, (shape, k, needs_dx) in CASES.items():
        forward, tensors, dy = steps_for(shape, k, needs_dx, device, dtype)
        row = {"case": name, "device": torch.cuda.get_device_name(device),
               "torch": torch.__version__, "dtype": "bf16"}  # fmt: skip
        for whole, column in ((True, "step_us"), (False, "backward_us")):
            times = {v: [] for v in VARIANTS}
            for v in VARIANTS:  # warm-up: selection, the plans, cuBLAS's heuristics
                for _ in range(5):
                    timed(v, forward, tensors, dy, loaded, whole)
            for order in interleaved_orders(VARIANTS, args.steps):
                for v in order:
                    timed(v, forward, tensors, dy, loaded, whole)  # untimed, its own
                    times[v].append(timed(v, forward, tensors, dy, loaded, whole))
            row[column] = {v: round(statistics.median(t), 1) for v, t in times.items()}
        native_node.rows_gemm = loaded
        step = row["step_us"]
        row["cpp_over_rewrite"] = round(step["gemmconv_cpp_node"] / step["rewrite"], 3)
        row["python_over_rewrite"] = round(step["gemmconv_python_node"] / step["rewrite"], 3)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
