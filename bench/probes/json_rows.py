"""A probe's result rows: one JSON line per row, printed and appended to a file, so a
run cut short keeps every row it finished."""

from __future__ import annotations

import json


def emit(row: dict, out: str | None) -> None:
    """Print ``row`` as one JSON line and, with ``out``, append it to that file."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
