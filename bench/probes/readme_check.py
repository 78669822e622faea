"""Runs the README's Python examples and driver commands on this machine and prints what
each printed, so the README's comments can be checked against a GPU machine's output;
then times how long `gemmconv conv` takes to stop after Ctrl-C (SIGINT) mid-run.

    PYTHONPATH=src python3 bench/probes/readme_check.py [python] [driver] [tune] [interrupt]

With no argument it runs all four parts, in that order.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = [sys.executable, "-m", "gemmconv"]
COMMANDS = (
    "conv -n 9500 -c 3 -H 14 -W 14 -k 1280 -y 14 -x 14 -u 14 -v 14",
    "demo",
    "solvers -n 256 -c 3 -H 224 -W 224 -k 768 -y 16 -x 16 -u 16 -v 16 --layout NHWC",
    "profile timm:vit_small_patch16_224 --batch 8",
    "profile hf:SiglipVisionConfig -o image_size=224 --batch 8",
)
PROBLEMS = """# one problem per line, as conv flags; # starts a comment
-n 8 -c 3 -H 224 -W 224 -k 768 -y 16 -x 16 -u 16 -v 16          # ViT-B/16 patch embed
-n 8 -c 64 -H 56 -W 56 -k 64 -y 1 -x 1 --layout NHWC            # ResNet 1x1, channels-last
"""


def run(argv: list[str], timeout: float, cwd: Path) -> None:
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as late:
        output, status = f"{late.stdout or ''}{late.stderr or ''}", f"timeout {timeout:g} s"
    print(f"--- exit {status} in {time.perf_counter() - start:.1f} s")
    print(output.rstrip()[-3000:], flush=True)


def interrupt_delay(seconds_before: float = 8.0) -> None:
    """Start the GPU-size conv, send SIGINT after a while, time until it exits."""
    command = DRIVER + ["conv", *COMMANDS[0].split()[1:], "-t", "1", "-i", "20000"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(seconds_before)
    sent = time.perf_counter()
    child.send_signal(signal.SIGINT)
    try:
        output, _ = child.communicate(timeout=60)
        print(
            f"=== Ctrl-C after {seconds_before:g} s: exit {child.returncode}"
            f" {time.perf_counter() - sent:.2f} s after the signal"
        )
        print(output.rstrip()[-800:], flush=True)
    except subprocess.TimeoutExpired:
        child.kill()
        print("=== Ctrl-C: still running 60 s after the signal", flush=True)


def main(parts: list[str]) -> None:
    parts = parts or ["python", "driver", "tune", "interrupt"]
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = (
        f"{ROOT / 'src'}{os.pathsep}{env_path}" if env_path else str(ROOT / "src")
    )
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        for number, block in enumerate(blocks if "python" in parts else []):
            print(f"=== README python block {number}:\n{block.strip()[:400]}")
            script = work / f"block{number}.py"
            script.write_text(block)
            run([sys.executable, str(script)], 300, work)
        (work / "problems.txt").write_text(PROBLEMS)
        commands = [
            *(COMMANDS if "driver" in parts else ()),
            *(["tune problems.txt"] if "tune" in parts else []),
        ]
        for command in commands:
            print(f"=== gemmconv {command}")
            run(DRIVER + command.split(), 300, work)
    if "interrupt" in parts:
        interrupt_delay()


if __name__ == "__main__":
    main(sys.argv[1:])
