"""CI's script (.ci/run) runs the README's test command and fails when any step of it
fails: the command is an && list, and bash's set -e stops only at its last command, so
a failed install once left the run green (a full disk)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv .venv && .*pytest.*$", readme, flags=re.MULTILINE)
    assert len(commands) == 1, commands
    return commands[0]


def _ci_line(command: str) -> str:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if command in line]
    assert len(lines) == 1, "CI must run the README's test command once"
    return lines[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash, as .ci/run does")
@pytest.mark.parametrize("step", ["python3 -m venv .venv", ".venv/bin/pip install", "pytest"])
def test_a_failing_step_of_the_readme_command_fails_ci(step):
    command = _readme_test_command()
    line = _ci_line(command)
    # Each step in turn replaced by `false`, the others by `true`, under .ci/run's options.
    steps = [s.strip() for s in command.split("&&")]
    stubbed = " && ".join("false" if step in s else "true" for s in steps)
    script = "set -euo pipefail\n" + line.replace(command, stubbed) + "\necho still-running\n"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert result.returncode != 0
    assert "still-running" not in result.stdout
