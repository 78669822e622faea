"""Every benchmark run committed under bench/results, as one long-format CSV.

bench/results keeps only the current table per device; the runs before are in git. This
reads every version of every JSON result file that ever sat in bench/results (suite,
public-call and end-to-end tables), finds the commit each was measured at (the file's
note, else the first commit named at the head of its Markdown twin), and writes one row
per measured case and metric:

    python bench/history_table.py > bench/results/history.csv

Columns: device, commit (measured at), torch, table (suite / api / e2e), metric
(device_time: kernels alone, L2 flushed; call_time: the public call as a user makes it;
step_time: a whole model step), case, layout, direction, dtype, variant (e2e only),
solver (gemmconv's pick), gemmconv_ms, torch_ms (cuDNN or aten on the CPU), rewrite_ms
(reshape + F.linear), floor_ms (roofline, suite device time only), host_handoff_us (a
one-op backward's hand-off to autograd's device thread, where recorded), source
(file@repository commit that recorded it). commit is empty where neither the file nor
the commit that recorded it names the tree measured. Times are copied as stored,
unrounded.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

RESULTS = "bench/results"
COLUMNS = [
    "device",
    "commit",
    "torch",
    "table",
    "metric",
    "case",
    "layout",
    "direction",
    "dtype",
    "variant",
    "solver",
    "gemmconv_ms",
    "torch_ms",
    "rewrite_ms",
    "floor_ms",
    "host_handoff_us",
    "source",
]
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout


def is_commit(token: str) -> bool:
    probe = subprocess.run(
        ["git", "cat-file", "-e", f"{token}^{{commit}}"], capture_output=True, cwd=ROOT
    )
    return probe.returncode == 0


STATED = (
    re.compile(r"\bat commit ([0-9a-f]{7,40})\b"),
    re.compile(r"\bcommit ([0-9a-f]{7,40})\b"),
)
TWIN = re.compile(r"of `([\w.]+\.md)`")


def stated_commit(text: str) -> str:
    """The commit a note says it was measured at ('at commit X'), if it says so."""
    for pattern in STATED:
        for token in pattern.findall(text[:1500]):
            if is_commit(token):
                return token[:7]
    return ""


def measured_commit(notes: list[str], commit: str, folder: str, message: str) -> str:
    """The notes' stated commit; else that of the table they say they ran beside
    ('on the H200 of `h200.md`'); else the recording commit message's 'at X'; else the
    first commit any of them names."""
    for text in notes:
        if found := stated_commit(text):
            return found
    for text in notes:
        for name in TWIN.findall(text[:1500]):
            twin = show(commit, f"{folder}/{name}")
            if twin and (found := stated_commit(twin)):
                return found
    for token in re.findall(r"\bat ([0-9a-f]{7,40})\b", message):
        if is_commit(token):
            return token[:7]
    for text in [*notes, message]:
        for token in HEX.findall(text[:1500]):
            if is_commit(token):
                return token[:7]
    return ""


def versions() -> list[tuple[str, str]]:
    """(repository commit, path) for each change to a JSON file in bench/results, oldest
    first; deletions are skipped."""
    log = git("log", "--reverse", "--format=@%h", "--name-status", "--", f"{RESULTS}/*.json")
    out, commit = [], ""
    for line in log.splitlines():
        if line.startswith("@"):
            commit = line[1:]
        elif line.strip():
            status, *paths = line.split("\t")
            if not status.startswith("D"):
                out.append((commit, paths[-1]))
    return out


def show(commit: str, path: str) -> str | None:
    try:
        return git("show", f"{commit}:{path}")
    except subprocess.CalledProcessError:
        return None


def rows_of(data: dict, table: str) -> list[dict]:
    base = {"device": data.get("device", ""), "torch": data.get("torch", "")}
    base["host_handoff_us"] = _handoff(data.get("backward_handoff_us"))
    out = []
    for r in data.get("rows", []):
        if table == "suite":
            common = dict(
                base,
                table="suite",
                case=r["case"],
                layout=r["layout"],
                direction=r["direction"],
                dtype=r["dtype"],
                solver=r.get("solver", ""),
            )
            out.append(
                dict(
                    common,
                    metric="device_time",
                    gemmconv_ms=r.get("gemmconv_ms"),
                    torch_ms=r.get("vendor_ms"),
                    rewrite_ms=r.get("linear_ms"),
                    floor_ms=r.get("floor_ms"),
                )
            )
            if r.get("api_ms") is not None:
                out.append(
                    dict(
                        common,
                        metric="call_time",
                        gemmconv_ms=r.get("api_ms"),
                        torch_ms=r.get("vendor_api_ms"),
                        rewrite_ms=r.get("linear_api_ms"),
                    )
                )
        elif table == "api":
            solvers = r.get("solvers") or {}
            out.append(
                dict(
                    base,
                    table="api",
                    metric="call_time",
                    case=r["case"],
                    layout=r["layout"],
                    direction=r["kind"],
                    dtype=r["dtype"],
                    solver="/".join(str(solvers[k]) for k in sorted(solvers)),
                    gemmconv_ms=r.get("gemmconv_ms"),
                    torch_ms=r.get("torch_ms"),
                    rewrite_ms=r.get("linear_ms"),
                )
            )
        else:
            out.append(
                dict(
                    base,
                    table="e2e",
                    metric="step_time",
                    case=r["scenario"],
                    variant=r["variant"],
                    **{_e2e_column(r["variant"]): r.get("ms")},
                )
            )
    return out


def _handoff(value) -> str:
    # Recorded as a dict of thread -> us in the reports that have it.
    if isinstance(value, dict):
        return ";".join(f"{k}={v}" for k, v in sorted(value.items()))
    return "" if value is None else str(value)


def _e2e_column(variant: str) -> str:
    return {"torch": "torch_ms", "linear": "rewrite_ms"}.get(variant, "gemmconv_ms")


def kind_of(data: dict) -> str | None:
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows or not isinstance(rows, list):
        return None
    first = rows[0]
    if "direction" in first and "vendor_ms" in first:
        return "suite"
    if "scenario" in first:
        return "e2e"
    if "kind" in first and "torch_ms" in first:
        return "api"
    return None


def main() -> None:
    writer = csv.DictWriter(sys.stdout, COLUMNS, lineterminator="\n")
    writer.writeheader()
    seen: set[str] = set()
    for commit, path in versions():
        text = show(commit, path)
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "runs" in data:
            # A table put together from several partial runs: their rows, one table.
            parts = [run["result"] for run in data["runs"] if "result" in run]
            data = dict(parts[0], rows=[r for part in parts for r in part.get("rows", [])])
        table = kind_of(data) if isinstance(data, dict) else None
        if table is None:
            continue
        # A version whose rows repeat an earlier one's (a note reworded) adds nothing.
        rows_key = json.dumps(data["rows"], sort_keys=True)
        if rows_key in seen:
            continue
        seen.add(rows_key)
        notes = [str(data.get("note", ""))]
        twin = show(commit, str(Path(path).with_suffix(".md")))
        if twin:
            notes.append(twin)
        message = git("log", "-1", "--format=%B", commit)
        measured = measured_commit(notes, commit, str(Path(path).parent), message)
        source = f"{path}@{commit}"
        for row in rows_of(data, table):
            row.update(commit=measured, source=source)
            writer.writerow({k: row.get(k, "") for k in COLUMNS})


if __name__ == "__main__":
    main()
