"""The end-to-end benchmark (`gemmconv bench --models`): whole model steps, wall clock.

For each scenario of gemmconv.bench.scenarios, every variant (torch, converted,
converted_channels_last, linear) is built from the same random model in one process;
each is warmed up (compilation happens there), then the variants take their timed
steps in turn, interleaved, in a fresh random order each round
(timing.interleaved_orders). Each turn is two steps, the first untimed: a step right
after another variant's pays for the switch, which a user running one model never
does (on an H100 a compiled CUDA-graph step was issued 55 us later right after the
other variant's step than right after its own, bench/results/cudagraph_step_h100.txt).
A step's time is the wall clock from an idle device to the end of the step
(synchronised); a variant's time is the median of its steps. The first warm-up
output of every variant is compared with torch's, so a fast wrong answer cannot pass
unnoticed.

Results go to <out>/<device>_e2e.json and .md, rewritten after every scenario so a run
cut short keeps what finished; no scenario starts once ``--time-budget`` seconds have
passed. The scenarios that need CUDA (torch.compile, CUDA graphs) are skipped on the
CPU, and the results say so.

    gemmconv bench --models                       # every scenario (about 8 minutes, H200)
    gemmconv bench --models --scenarios vit_b16_train_b256,qwen2vl_vision_infer_8192
    gemmconv bench --models --device cpu --quick  # tiny models: the pipeline, not a measurement
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gemmconv.bench.host_probe import host_fields, host_lines
from gemmconv.bench.report import check_status, default_stem, native_node_text, targets_line
from gemmconv.bench.scenarios import (
    SCENARIOS,
    VARIANTS,
    Scenario,
    build_workload,
    make_step,
    prepare_variant,
    scenarios,
)
from gemmconv.bench.suite import bench_device, environment
from gemmconv.measuring.timing import interleaved_orders
from gemmconv.measuring.verify import rms_range
from gemmconv.selection import dispatch
from gemmconv.terminal.usage import Parser, UsageError, int64, reports_usage_errors

# The end-to-end targets, on the better of the two converted variants.
NOT_SLOWER_THAN_LINEAR = 1.005  # the noise of a median of 20 steps
NOT_SLOWER_THAN_TORCH = 1.01
MUST_BEAT_TORCH = frozenset({
    "vit_b16_train_b256", "vit_b16_train_b256_compiled", "qwen2vl_patch_embed_fwd",
    "qwen2vl_patch_embed_fwd_bwd", "qwen2vl_vision_infer_8192", "vit_b16_infer_b8_cudagraphs",
})  # fmt: skip
# A variant's first output agrees with torch's when their rms_range is within this:
# bf16 rounding differences in one layer, carried through the network, stay far below
# it (about 0.003 on the quick CPU models), while a wrong patch embed moves the output
# by a large fraction of its range (a doubled one: above 0.05, tests/bench/test_bench_models.py).
AGREEMENT = 0.05
# A quick run's scenario names (tiny_...) to the full ones the targets are set for.
_FULL_NAMES = {s.shown_name(True): s.name for s in SCENARIOS}
CONVERTED = ("converted", "converted_channels_last")


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def run_scenario(
    s: Scenario,
    device: torch.device,
    quick: bool,
    steps: int,
    warmup: int,
    variants: Sequence[str] = VARIANTS,
    log: Callable[[str], None] = print,
) -> dict:
    """Every variant of ``s``: {"rows": [...], "not_applicable": [...], "errors": [...]}."""
    sync = _sync(device)
    name = s.shown_name(quick)
    out: dict = {"rows": [], "not_applicable": [], "errors": []}
    workload = build_workload(s, device, quick)
    runners, changed = {}, {}
    for variant in variants:
        try:
            prepared = prepare_variant(workload.model, variant)
            if prepared is None:
                out["not_applicable"].append(
                    {
                        "scenario": name,
                        "variant": variant,
                        "reason": "the model has no patch convolution to rewrite",
                    }
                )
                continue
            model, changed[variant] = prepared
            runners[variant] = make_step(s, model, workload, device)
        except Exception as exc:  # a variant that cannot be built must not lose the others
            out["errors"].append(_error(name, variant, "build", exc, log))
    workload.model = None  # the variants hold their own copies

    first_outputs, warmup_s = {}, {}
    for variant, step in list(runners.items()):
        try:
            started = time.perf_counter()
            first_outputs[variant] = step().detach().float().clone()
            for _ in range(warmup - 1):
                step()
            sync()
            warmup_s[variant] = time.perf_counter() - started
        except Exception as exc:
            out["errors"].append(_error(name, variant, "warm-up", exc, log))
            del runners[variant]

    samples: dict[str, list[float]] = {v: [] for v in runners}
    for i, order in enumerate(interleaved_orders(list(runners), steps * s.steps_multiple)):
        for variant in order:
            if variant not in runners:
                continue
            try:
                runners[variant]()  # the untimed step that absorbs the switch
                sync()  # the device is idle when the step starts
                started = time.perf_counter()
                runners[variant]()
                sync()
                samples[variant].append((time.perf_counter() - started) * 1000.0)
            except Exception as exc:
                out["errors"].append(_error(name, variant, f"step {i}", exc, log))
                del runners[variant]

    reference = first_outputs.get("torch")
    for variant in runners:
        times = samples[variant]
        disagreement = None if reference is None else rms_range(first_outputs[variant], reference)
        out["rows"].append(
            {
                "scenario": name,
                "variant": variant,
                "ms": statistics.median(times),
                "min_ms": min(times),
                "samples_ms": times,
                "steps": len(times),
                "warmup": warmup,
                "warmup_s": warmup_s[variant],
                "batch": s.quick_batch if quick else s.batch,
                "changed_modules": changed[variant],
                "rms_vs_torch": disagreement,
                "agrees_with_torch": None if disagreement is None else disagreement <= AGREEMENT,
            }
        )
    del runners, first_outputs, workload
    _release(device, compiled=s.compile_mode is not None)
    return out


def _error(name: str, variant: str, where: str, exc: Exception, log) -> dict:
    message = f"{type(exc).__name__}: {exc}"[:500]
    log(f"{name}/{variant}: FAILED in {where}: {message}")
    return {"scenario": name, "variant": variant, "where": where, "error": message}


def _release(device: torch.device, compiled: bool) -> None:
    """Free one scenario's models before the next (compiled graphs and CUDA graph pools
    included)."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _versions() -> dict:
    versions = {}
    for name in ("timm", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return versions


def _empty_results(device: torch.device, quick: bool, steps: int, warmup: int) -> dict:
    """A run's results before its first scenario: where and how it runs, and the
    lists the scenarios fill."""
    return {
        **environment(device),
        **host_fields(device, quick),
        **_versions(),
        "quick": quick,
        "steps": steps,
        "warmup": warmup,
        "find_mode": dispatch.current_find_mode().value,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "timing": "wall clock per step from an idle device to the synchronised end, median "
        "of the steps, variants interleaved turn by turn in one process, each timed step "
        "right after an untimed step of its own variant",
        "seconds": 0.0,
        "truncated": False,
        "rows": [],
        "not_applicable": [],
        "skipped": [],
        "errors": [],
    }


def run(
    chosen: Sequence[Scenario],
    device: torch.device,
    quick: bool,
    steps: int,
    warmup: int,
    variants: Sequence[str] = VARIANTS,
    time_budget_s: float | None = None,
    log: Callable[[str], None] = print,
    on_scenario: Callable[[dict], None] | None = None,
) -> dict:
    started = time.time()
    results = _empty_results(device, quick, steps, warmup)
    for s in chosen:
        if s.cuda_only and device.type != "cuda":
            reason = f"needs CUDA (torch.compile mode {s.compile_mode!r} is run on CUDA only)"
            results["skipped"].append({"scenario": s.shown_name(quick), "reason": reason})
            log(f"{s.shown_name(quick)}: SKIPPED: {reason}")
            continue
        if time_budget_s is not None and time.time() - started >= time_budget_s:
            results["truncated"] = True
            reason = f"time budget of {time_budget_s:g} s spent"
            results["skipped"].append({"scenario": s.shown_name(quick), "reason": reason})
            log(f"{s.shown_name(quick)}: SKIPPED: {reason}")
            continue
        log(f"{s.shown_name(quick)}: {s.shown_title(quick)}")
        try:
            part = run_scenario(s, device, quick, steps, warmup, variants, log)
        except Exception as exc:  # the model or its inputs could not be built
            results["errors"].append(_error(s.shown_name(quick), "*", "build", exc, log))
            _release(device, compiled=s.compile_mode is not None)
            continue
        for key in ("rows", "not_applicable", "errors"):
            results[key] += part[key]
        for row in part["rows"]:
            log(f"  {row['variant']:<24} {row['ms']:10.3f} ms (min {row['min_ms']:.3f})")
        results["seconds"] = time.time() - started
        if on_scenario is not None:
            on_scenario(results)
    results["seconds"] = time.time() - started
    return results


# ---- verdicts and the report ---------------------------------------------------------


def verdicts(results: dict) -> list[dict]:
    """Per scenario with rows: the better converted variant against torch and linear,
    as ratios converted_ms / other_ms (below 1: converted is faster), and the targets."""
    by_scenario: dict[str, dict[str, float]] = {}
    for r in results["rows"]:
        by_scenario.setdefault(r["scenario"], {})[r["variant"]] = r["ms"]
    out = []
    for name, ms in by_scenario.items():
        converted = {v: ms[v] for v in CONVERTED if v in ms}
        if not converted:
            continue
        best = min(converted, key=converted.get)
        entry = {"scenario": name, "best_converted": best, "converted_ms": converted[best]}
        if "torch" in ms:
            ratio = converted[best] / ms["torch"]
            must_beat = _FULL_NAMES.get(name, name) in MUST_BEAT_TORCH
            entry["vs_torch"] = ratio
            entry["torch_target"] = "< 1 (faster)" if must_beat else f"<= {NOT_SLOWER_THAN_TORCH}"
            entry["torch_met"] = ratio < 1.0 if must_beat else ratio <= NOT_SLOWER_THAN_TORCH
        if "linear" in ms:
            ratio = converted[best] / ms["linear"]
            entry["vs_linear"] = ratio
            entry["linear_target"] = f"<= {NOT_SLOWER_THAN_LINEAR}"
            entry["linear_met"] = ratio <= NOT_SLOWER_THAN_LINEAR
        out.append(entry)
    return out


def unmet_targets(checks: list[dict]) -> tuple[int, list[str]]:
    """How many targets the verdicts check (against torch and against linear, per
    scenario), and a short text for each one not met."""
    checked, unmet = 0, []
    for check in checks:
        for other in ("torch", "linear"):
            if f"vs_{other}" not in check:
                continue
            checked += 1
            if not check[f"{other}_met"]:
                unmet.append(
                    f"{check['scenario']} best/{other} {check[f'vs_{other}']:.3f} "
                    f"(target {check[f'{other}_target']})"
                )
    return checked, unmet


def _cell(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _more_steps(steps: int, quick: bool) -> str:
    """The scenarios that take more than the run's ``steps``, and how many, in words."""
    more = [
        f"{s.shown_name(quick)} {steps * s.steps_multiple}"
        for s in SCENARIOS
        if s.steps_multiple > 1
    ]
    return f"; more steps in {', '.join(more)}" if more else ""


def markdown(results: dict, checks: list[dict]) -> str:
    flags = []
    if results["quick"]:
        flags.append("QUICK (tiny models, not a measurement)")
    if results["truncated"]:
        flags.append("TRUNCATED (time budget spent)")
    lines = [
        f"# End to end: {results['device']}" + "".join(f" — {f}" for f in flags),
        "",
        f"torch {results['torch']}, cuDNN {results['cudnn']}, CUDA {results['cuda']}, triton "
        f"{results['triton']}, timm {results['timm']}, transformers {results['transformers']}, "
        f"gemmconv {results['gemmconv']}{native_node_text(results)}; gemmconv selection mode "
        f"{results['find_mode']}, "
        f"cudnn.benchmark {results['cudnn_benchmark']}.",
        "",
        *host_lines(results),
        f"Milliseconds per step: {results['timing']} ({results['steps']} steps after "
        f"{results['warmup']} warm-up{_more_steps(results['steps'], results['quick'])}). "
        "converted = gemmconv.convert(model); "
        "converted_channels_last = gemmconv.convert(model, memory_format=torch.channels_last); "
        "linear = every patch convolution replaced by reshape + F.linear. Ratios are the "
        "better converted variant's time over torch's and over linear's (below 1: converted "
        "is faster); — where a variant does not apply or did not run.",
        "",
        "| scenario | torch | converted | converted_channels_last | linear | best/torch "
        "| target | best/linear | target |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    ms = {(r["scenario"], r["variant"]): r["ms"] for r in results["rows"]}
    for check in checks:
        name = check["scenario"]
        cells = " | ".join(_cell(ms.get((name, v))) for v in VARIANTS)
        torch_target = (
            f"{check['torch_target']}: {'met' if check['torch_met'] else 'NOT met'}"
            if "vs_torch" in check
            else "—"
        )
        linear_target = (
            f"{check['linear_target']}: {'met' if check['linear_met'] else 'NOT met'}"
            if "vs_linear" in check
            else "—"
        )
        lines.append(
            f"| {name} | {cells} | {_cell(check.get('vs_torch'))} | {torch_target} "
            f"| {_cell(check.get('vs_linear'))} | {linear_target} |"
        )
    notes = [
        f"- {n['scenario']}: no {n['variant']} row: {n['reason']}"
        for n in results["not_applicable"]
    ]
    notes += [f"- {s['scenario']}: not run: {s['reason']}" for s in results["skipped"]]
    notes += [
        f"- {r['scenario']}/{r['variant']}: output DISAGREES with torch's (rms_range "
        f"{r['rms_vs_torch']:.3g} > {AGREEMENT})"
        for r in results["rows"]
        if r["agrees_with_torch"] is False
    ]
    notes += [
        f"- {e['scenario']}/{e['variant']}: FAILED in {e['where']}: {e['error']}"
        for e in results["errors"]
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: str | Path, stem: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checks = verdicts(results)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps({**results, "verdicts": checks}, indent=1) + "\n")
    paths[1].write_text(markdown(results, checks))
    return paths


# ---- command line --------------------------------------------------------------------


def _parser() -> Parser:
    ap = Parser(prog="gemmconv bench --models", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--models", action="store_true", help="this benchmark (how `gemmconv bench` routes)"
    )
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny models (the tests run this)")
    ap.add_argument("--check", action="store_true", help="exit status 1 when a target is not met")
    ap.add_argument("--scenarios", default="", help="comma list of scenario names (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
    ap.add_argument("--steps", type=int64, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int64, default=3, help="untimed steps per variant first")
    ap.add_argument(
        "--time-budget", type=float, default=None, help="seconds after which no scenario starts"
    )
    ap.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="set torch.backends.cudnn.benchmark (gemmconv finds too)",
    )
    ap.add_argument(
        "--out",
        default="gemmconv-bench",
        help="directory for the result files (the committed ones: bench/results)",
    )
    ap.add_argument("--name", default=None, help="file stem (default: <device>_e2e)")
    return ap


@reports_usage_errors("gemmconv bench --models")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = bench_device(args.device)
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup)):
        if value < 1:
            raise UsageError(f"{flag} {value}: expected a value >= 1")
    try:
        chosen = scenarios([n for n in args.scenarios.split(",") if n], quick=args.quick)
    except ValueError as e:
        raise UsageError(f"--scenarios: {e}") from None
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        raise UsageError(
            f"--variants {args.variants}: expected a comma list of {', '.join(VARIANTS)}"
        )
    missing = [name for name, version in _versions().items() if version is None]
    if missing:
        raise UsageError(
            f"gemmconv bench --models builds timm and transformers models; "
            f"{', '.join(missing)} not installed (pip install 'gemmconv[models]')"
        )
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    stem = args.name or f"{default_stem(environment(device)['device'])}_e2e"

    def save(partial: dict) -> None:
        write(partial, args.out, stem)

    results = run(
        chosen,
        device,
        args.quick,
        args.steps,
        args.warmup,
        variants,
        args.time_budget,
        on_scenario=save,
    )
    paths = write(results, args.out, stem)
    for path in paths:
        print(f"wrote {path}")
    print(paths[1].read_text().split("\n\n", 3)[-1], end="")
    checked, unmet = unmet_targets(verdicts(results))
    print(targets_line(checked, unmet, args.quick))
    disagree = [r for r in results["rows"] if r["agrees_with_torch"] is False]
    if results["errors"] or disagree:
        return 1
    return check_status(checked, unmet) if args.check else 0


__all__ = ["main", "markdown", "run", "run_scenario", "unmet_targets", "verdicts"]

if __name__ == "__main__":
    raise SystemExit(main())
