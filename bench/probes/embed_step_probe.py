"""Where a patch-embed step from an idle device goes (a diagnostic, not a benchmark).

The end-to-end table's Qwen2-VL patch embed step (gemmconv.bench.scenarios) runs from an
idle device to a synchronised end, so the host's path to each kernel shows in full.
This times that step for torch, the converted module and the reshape + F.linear
rewrite, and beside them hand-written autograd Functions doing the same GEMMs, each a
step closer to the converted module's path (REPLICAS: without gemmconv's precision
rule, with its context manager, with the prepared runs' inline switch, then with their
as_strided views and 5-D output, then saving the input too), so the gap between the
converted module and the rewrite splits into the node, the precision rule, the views,
the saved input and the rest of gemmconv's path. Prints the forward's ladder (each
layer of the converted module's inference call timed alone, down to the bare F.linear),
the median step in us of interleaved steps, then profiles (cProfile, torch.profiler)
of the steps.

    PYTHONPATH=src python bench/probes/embed_step_probe.py --patches 8192
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from host_profile import issue_us  # this folder is the script's first import path

import gemmconv
from gemmconv.bench.scenarios import SCENARIOS, build_workload, make_step, prepare_variant
from gemmconv.core.precision import conv_gemm_precision, with_conv_precision
from gemmconv.measuring.timing import interleaved_orders
from gemmconv.roads import eager, ops
from gemmconv.solvers.base import ConvTensors


@dataclasses.dataclass(frozen=True)
class _Replica:
    """A hand-written autograd Function doing the patch embed's GEMMs (y = rows @ W^T,
    dW = dY^T rows, nothing else), and how close it comes to the converted module's
    path: ``precision`` "none", "context" (gemmconv's conv_gemm_precision around each
    GEMM) or "inline" (with_conv_precision's switch, as prepared runs make it);
    ``views`` takes the 5-D input and weight and returns y as the convolution's 5-D
    output, each through one as_strided inside the Function, as the prepared run's
    ViewRecipes and ResultBuffer do; ``saves_input`` also saves the 5-D input, as the
    eager node does for a differentiated backward. Each step towards the converted
    module adds one of these, so the probe splits the gap into them and gemmconv's
    Python layers (module, functional call, eager road, plan)."""

    precision: str
    views: bool = False
    saves_input: bool = False


REPLICAS = {
    "function_plain": _Replica("none"),
    "function_precise": _Replica("context"),
    "function_inline": _Replica("inline"),
    "function_views": _Replica("inline", views=True),
    "function_saves_input": _Replica("inline", views=True, saves_input=True),
}


def _gemm(replica: _Replica, gemm, dtype: torch.dtype, device_type: str):
    """``gemm`` under the replica's precision rule."""
    if replica.precision == "inline":
        return with_conv_precision(dtype, device_type, gemm)
    if replica.precision == "context":

        def in_context(*args):
            with conv_gemm_precision(dtype, device_type):
                return gemm(*args)

        return in_context
    return gemm


class _ReplicaPlan:
    """What a replica's call of one batch size reads, found once (as gemmconv's plans
    are): the GEMMs under the precision rule, and the as_strided views."""

    def __init__(self, replica: _Replica, weight: torch.Tensor, n: int) -> None:
        self.replica = replica
        k, features = weight.shape[0], weight[0].numel()
        self.linear = _gemm(replica, F.linear, weight.dtype, weight.device.type)
        self.mm = _gemm(replica, torch.mm, weight.dtype, weight.device.type)
        self.rows = ((n, features), (features, 1))
        self.w2d = ((k, features), (features, 1))
        self.y = ((n, k, 1, 1, 1), (k, 1, k, k, k))
        self.dy_rows = ((n, k), (k, 1))
        self.dw = (tuple(weight.shape), weight.stride())


class _ReplicaEmbed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, plan):  # type: ignore[override]
        views = plan.replica.views
        rows = x.as_strided(*plan.rows) if views else x
        w2d = weight.as_strided(*plan.w2d) if views else weight
        ctx.save_for_backward(rows, x if plan.replica.saves_input else None)
        ctx.plan = plan
        y = plan.linear(rows, w2d)
        return y.as_strided(*plan.y) if views else y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        rows, _ = ctx.saved_tensors
        plan = ctx.plan
        if not plan.replica.views:
            return None, plan.mm(dy.t(), rows), None
        dw = plan.mm(dy.as_strided(*plan.dy_rows).t(), rows)
        return None, dw.as_strided(*plan.dw), None


class _ReplicaConv(torch.nn.Module):
    """A patch convolution (kernel = stride, one patch a sample) computed by
    _ReplicaEmbed as ``replica`` says; it takes the place of the convolution inside
    transformers' PatchEmbed, so every variant runs inside the same wrapper."""

    def __init__(self, conv: torch.nn.Conv3d, replica: _Replica) -> None:
        super().__init__()
        self.weight = conv.weight
        self.replica = replica
        self.plans: dict[int, _ReplicaPlan] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, weight = x.shape[0], self.weight
        plan = self.plans.get(n)
        if plan is None:
            plan = self.plans[n] = _ReplicaPlan(self.replica, weight, n)
        if self.replica.views:
            return _ReplicaEmbed.apply(x, weight, plan)
        k = weight.shape[0]
        y = _ReplicaEmbed.apply(x.view(n, -1), weight.view(k, -1), plan)
        return y.view(n, k, 1, 1, 1)


def _precision_context_cost(device: torch.device, sync) -> None:
    """Host us per back-to-back F.linear of the patch embed's forward GEMM: plain, inside
    gemmconv's precision context manager (the flag turned off and back per call), with
    the flag switched inline as prepared runs do (with_conv_precision), and with the
    flag off for the whole loop (no switching)."""
    x2d = torch.randn(8192, 1176, device=device, dtype=torch.bfloat16)
    w2d = torch.randn(1280, 1176, device=device, dtype=torch.bfloat16)

    def plain():
        F.linear(x2d, w2d)

    def switched():
        with conv_gemm_precision(x2d.dtype, device.type):
            F.linear(x2d, w2d)

    # What a prepared run does: the bf16 flag switched inline, no context manager.
    bf16_flag_only = with_conv_precision(x2d.dtype, device.type, plain)

    def per_call(fn, calls=300):
        for _ in range(20):
            fn()
        return issue_us(fn, calls, sync, passes=1)

    print("host us to issue one F.linear [8192x1176] @ [1176x1280]^T, back to back:")
    print(f"  plain                       {per_call(plain):8.1f}")
    print(f"  in the precision context    {per_call(switched):8.1f}")
    print(f"  bf16 flag switched inline   {per_call(bf16_flag_only):8.1f}")
    with conv_gemm_precision(x2d.dtype, device.type):
        print(f"  flags off for the whole loop {per_call(plain):7.1f}")


def _forward_ladder(device: torch.device, patches: int, rounds: int, sync) -> None:
    """The inference forward of the Qwen2-VL patch embed, layer by layer: the whole
    PatchEmbed (rewrite, converted), its convolution module, gemmconv.conv3d, the eager
    road, the forward plan's run, the prepared run, and the GEMM on views with and
    without the precision switch. Per layer, the host's us per call back to back and
    the median us per call from an idle device (the end-to-end table's regime); the
    differences between neighbouring layers are what each layer adds."""
    s = dataclasses.replace(
        next(x for x in SCENARIOS if x.name == "qwen2vl_patch_embed_fwd"), batch=patches
    )
    w = build_workload(s, device, quick=False)
    converted, _ = prepare_variant(w.model, "converted")
    rewrite, _ = prepare_variant(w.model, "linear")
    (pixels,) = w.inputs
    conv = converted.proj
    x = pixels.view(-1, conv.in_channels, *conv.kernel_size)
    weight = conv.weight
    args = (conv.stride, conv.padding, conv.dilation, conv.groups)
    x2d, w2d = x.view(x.shape[0], -1), weight.view(weight.shape[0], -1)
    with torch.inference_mode():
        eager.clear()
        conv(x)
        (call,) = eager._calls.values()
    tensors = ConvTensors(x, weight, None)
    switched = with_conv_precision(x.dtype, device.type, F.linear)
    rungs = {
        "rewrite PatchEmbed": lambda: rewrite(pixels),
        "converted PatchEmbed": lambda: converted(pixels),
        "rewrite proj module": lambda: rewrite.proj(x),
        "converted proj module": lambda: conv(x),
        "gemmconv.conv3d": lambda: gemmconv.conv3d(x, weight, None, *args),
        "eager.convolve": lambda: eager.convolve(3, x, weight, None, *args),
        "ops.run_forward": lambda: ops.run_forward(call.plan, x, weight, None),
        "prepared run": lambda: call.plan.runner(tensors),
        "F.linear, flag switched": lambda: switched(x2d, w2d),
        "F.linear on views": lambda: F.linear(x2d, w2d),
    }
    hot = {name: [] for name in rungs}
    idle = {name: [] for name in rungs}
    with torch.inference_mode():
        for fn in rungs.values():
            for _ in range(20):
                fn()
        # Rounds in shuffled orders, as time_steps does: one-off timings of the layers
        # one after another moved by tens of us on the H100's host.
        for order in interleaved_orders(list(rungs), rounds):
            for name in order:
                fn = rungs[name]
                hot[name].append(issue_us(fn, 50, sync, passes=1))
                for _ in range(5):
                    sync()
                    start = time.perf_counter()
                    fn()
                    sync()
                    idle[name].append((time.perf_counter() - start) * 1e6)
    print(
        f"forward ladder, {patches} patches on {device}, inference mode, {rounds} rounds: "
        "median us per call"
    )
    for name in rungs:
        print(
            f"  {name:24s} host back to back {statistics.median(hot[name]):7.1f}"
            f"  idle-to-end {statistics.median(idle[name]):7.1f}",
            flush=True,
        )


def _steps(s, device, variants):
    w = build_workload(s, device, quick=False)
    steps = {}
    for v in variants:
        if v in REPLICAS:
            model, _ = prepare_variant(w.model, "torch")
            model.proj = _ReplicaConv(model.proj, REPLICAS[v])
        else:
            model, _ = prepare_variant(w.model, v)
        steps[v] = make_step(s, model, w, device)
    return steps


def time_steps(steps: dict, rounds: int, sync, title: str) -> None:
    """Time ``steps`` (name -> step) interleaved in a fresh order each round, each from
    an idle device, and print per step the median wall time to its synchronised end
    and the host's time to issue it, the latter also split by the step run just before
    (the host's caches hold what that step touched, so a fixed order would favour
    some)."""
    for step in steps.values():
        for _ in range(5):
            step()
    idle = {v: [] for v in steps}
    issue = {v: [] for v in steps}
    issue_after = {v: {u: [] for u in steps} for v in steps}
    previous = None
    for order in interleaved_orders(list(steps), rounds):
        for v in order:
            sync()
            start = time.perf_counter()
            steps[v]()
            issued = time.perf_counter()
            sync()
            idle[v].append((time.perf_counter() - start) * 1e6)
            issue[v].append((issued - start) * 1e6)
            if previous is not None:
                issue_after[v][previous].append((issued - start) * 1e6)
            previous = v
    print(f"{title}: median us per step, order shuffled")
    for v in steps:
        print(
            f"  {v:17s} idle-to-end {statistics.median(idle[v]):8.1f}"
            f"  host issue {statistics.median(issue[v]):8.1f}"
        )
    print("  host issue by the variant stepped before it:")
    for v in steps:
        cells = "  ".join(
            f"{u} {statistics.median(t):7.1f}" for u, t in issue_after[v].items() if t
        )
        print(f"    {v:17s} after  {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=25, help="rows of each profile")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    variants = ("torch", "converted", "linear", *REPLICAS)
    _precision_context_cost(device, sync)
    _forward_ladder(device, args.patches, args.steps, sync)
    for name in ("qwen2vl_patch_embed_fwd", "qwen2vl_patch_embed_fwd_bwd"):
        s = dataclasses.replace(next(x for x in SCENARIOS if x.name == name), batch=args.patches)
        steps = _steps(s, device, variants)
        time_steps(steps, args.steps, sync, f"{name}, {args.patches} patches on {device}")
        for v in ("converted", "linear", "function_precise"):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(200):
                steps[v]()
                sync()
            profiler.disable()
            report = io.StringIO()
            pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(args.top)
            print(f"{v} under cProfile, 200 steps:\n{report.getvalue()}", flush=True)
        for v in ("converted", "linear"):
            with torch.profiler.profile() as prof:
                for _ in range(20):
                    steps[v]()
                    sync()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
            print(f"{v} under torch.profiler, 20 steps:\n{table}", flush=True)


if __name__ == "__main__":
    main()
