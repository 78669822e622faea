"""Writing a bench/multi_gpu.py run: the JSON record and a markdown page with the step
times side by side, the ratios to torch and to the reshape + linear rewrite, the
checks and each rank's solver per problem."""

from __future__ import annotations

import json
from pathlib import Path

WRAPPER_TITLES = {"ddp": "DDP", "fsdp2": "FSDP2"}


def add_ratios(rows: list[dict]) -> None:
    """Each timed row's speed-up over torch and over the rewrite, same wrapper."""
    timed = {(r["wrapper"], r["variant"]): r["ms"] for r in rows if r["ms"] is not None}
    for r in rows:
        for base in ("torch", "linear"):
            base_ms = timed.get((r["wrapper"], base))
            ok = r["ms"] is not None and base_ms is not None
            r[f"speedup_vs_{base}"] = base_ms / r["ms"] if ok else None


def verdict(check: dict) -> str:
    return {True: "PASS", False: "FAIL", None: "NOT RUN"}[check["pass"]]


def markdown(results: dict) -> str:
    env, cfg = results["environment"], results["config"]
    wrappers = " and ".join(WRAPPER_TITLES[w] for w in cfg["wrappers"])
    lines = [
        f"# {cfg['model']} training step under {wrappers}, {cfg['world_size']} x {env['device']}",
        "",
        f"torch {env['torch']}, gemmconv {env['gemmconv']}, backend {cfg['backend']}, "
        f"batch {cfg['batch_per_rank']} per rank, image {cfg['image_size']}, bf16 autocast, "
        f"fused AdamW (lr {cfg['lr']:g}), find mode {cfg['find_mode']}. Step time: the "
        f"slowest rank's wall clock of zero_grad + forward + backward + optimizer step, "
        f"median of the last {cfg['timed']} of {cfg['steps']} steps, all rows in one run.",
        "",
        "| wrapper | variant | step ms | torch / this | linear / this | first step s "
        "(per rank) | peak GiB (per rank) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r["status"] != "ok":
            why = f"{r['status']}: {r['note']}"
            lines.append(f"| {r['wrapper']} | {r['variant']} | {why} | | | | |")
            continue
        lines.append(
            f"| {r['wrapper']} | {r['variant']} | {r['ms']:.2f} | {_ratio(r['speedup_vs_torch'])} "
            f"| {_ratio(r['speedup_vs_linear'])} | {_list(r['first_step_s'], '.2f')} "
            f"| {_list(r['peak_memory_gib'], '.2f')} |"
        )
    checks = results["checks"]
    lines += ["", "## Checks", ""]
    for name, check in checks.items():
        lines.append(f"- **{name}**: {verdict(check)}: {check['summary']}")
    decisions = checks.get("same_solvers", {}).get("decisions")
    if decisions:
        ranks = range(cfg["world_size"])
        lines += [
            "",
            "## Solver per problem and rank (decision source in brackets)",
            "",
            "| during | problem | mode | " + " | ".join(f"rank {r}" for r in ranks) + " |",
            "|---|---|---|" + "---|" * len(ranks),
        ]
        for d in decisions:
            cells = [f"{s} ({src})" for s, src in zip(d["solvers"], d["sources"])]
            head = f"| {d['during']} | {d['problem']} | {d['mode']} | "
            lines.append(head + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _list(values: list, spec: str) -> str:
    return " / ".join("n/a" if v is None else format(v, spec) for v in values)


def write_results(results: dict, out: Path, name: str) -> list[Path]:
    """``<out>/<name>.json`` and ``.md``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(markdown(results))
    return [json_path, md_path]
