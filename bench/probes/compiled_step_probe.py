"""Where a compiled model's step goes, per variant (a diagnostic, not a benchmark).

Under torch.compile a converted model's patch convolution is gemmconv's custom op,
called from inductor's graph as an opaque kernel, while the reshape + F.linear
rewrite is a permute and a matmul that inductor fuses with what is around them. In
the end-to-end table the rewrite led by 0.5-1.2% on the compiled training step and by
0.3-5.8% on the CUDA-graph inference step, the larger gaps on the slower hosts. This
times one compiled scenario's steps as bench/probes/embed_step_probe.py does (interleaved,
each from an idle device, host issue split by predecessor), then profiles a few steps
of each variant and counts what separates them: CUDA-graph launches, kernels launched
from the host (outside any graph), calls of gemmconv's ops and their host time (an op
called during a replay runs outside the graph: inductor partitioned around it), the
kernels' device time per step, and inductor's CUDA-graph counters.

    PYTHONPATH=src python bench/probes/compiled_step_probe.py vit_b16_infer_b8_cudagraphs
    PYTHONPATH=src python bench/probes/compiled_step_probe.py vit_b16_infer_b8_cudagraphs --quick
"""

from __future__ import annotations

import argparse

import torch
from embed_step_probe import time_steps  # this folder is the script's first import path
from torch.autograd import DeviceType

from gemmconv.bench.scenarios import build_workload, make_step, prepare_variant, scenarios

VARIANTS = ("torch", "converted", "converted_channels_last", "linear")


def _profile_counts(step, steps: int, sync) -> tuple[dict[str, float], dict[str, float]]:
    """Per step: CUDA-graph launches, host kernel launches, gemmconv op calls, their host
    us, and the device us of every kernel, from torch.profiler over ``steps`` steps;
    and each kernel's device us per step by name (to compare variants)."""
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            step()
        sync()
    counts = dict.fromkeys(("graph launches", "host kernel launches", "gemmconv op calls"), 0.0)
    counts["gemmconv op host us"] = counts["kernel device us"] = 0.0
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key
        if "GraphLaunch" in name:
            counts["graph launches"] += event.count
        elif "LaunchKernel" in name:
            counts["host kernel launches"] += event.count
        elif name.startswith("gemmconv::"):
            counts["gemmconv op calls"] += event.count
            counts["gemmconv op host us"] += event.cpu_time_total
        if event.device_type == DeviceType.CUDA:  # the kernels themselves, not their callers
            counts["kernel device us"] += event.self_device_time_total
            kernels[name] = kernels.get(name, 0.0) + event.self_device_time_total / steps
    return {key: value / steps for key, value in counts.items()}, kernels


def _cudagraph_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        f"{group}.{key}": value
        for group in ("inductor", "stats")
        for key, value in counters[group].items()
        if "cudagraph" in key or "partition" in key
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", help="an end-to-end scenario, usually a compiled one")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=40, help="timed rounds")
    parser.add_argument("--profiled", type=int, default=10, help="profiled steps per variant")
    parser.add_argument("--quick", action="store_true", help="the CPU-sized model")
    parser.add_argument("--top-kernels", type=int, default=15, help="kernels listed per variant")
    args = parser.parse_args()
    (s,) = scenarios([args.scenario])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    w = build_workload(s, device, quick=args.quick)
    steps = {}
    for v in args.variants:
        prepared = prepare_variant(w.model, v)
        if prepared is not None:
            steps[v] = make_step(s, prepared[0], w, device)
    time_steps(steps, args.steps, sync, f"{s.name} on {device}, torch {torch.__version__}")
    print(f"per step, over {args.profiled} profiled steps:")
    kernels = {}
    for v, step in steps.items():
        counts, kernels[v] = _profile_counts(step, args.profiled, sync)
        cells = "  ".join(f"{k} {x:.1f}" for k, x in counts.items())
        print(f"  {v:23s} {cells}", flush=True)
    for v, by_name in kernels.items():
        top = sorted(by_name.items(), key=lambda item: -item[1])[: args.top_kernels]
        print(f"{v}: the {len(top)} kernels with the most device us per step")
        for name, us in top:
            print(f"  {us:9.1f}  {name[:100]}")
    print("inductor's CUDA-graph counters (all variants):", _cudagraph_counters())


if __name__ == "__main__":
    main()
