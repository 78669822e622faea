"""Ctrl-C that acts at once, even in the middle of a long torch call.

Python turns SIGINT into KeyboardInterrupt only between bytecodes of the main thread,
so a command whose main thread is inside one long convolution (torch's bf16 weight
gradient of the demo case takes 44 s a call on a 2-core CPU) hears Ctrl-C only when
that call returns. ``run_interruptibly`` runs the command's work in a worker thread
and keeps the main thread waiting in short joins, where the interrupt is seen within
a fraction of a second; the process then ends, since the worker's torch call cannot
be stopped from outside.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
_POLL_SECONDS = 0.1


def run_interruptibly(work: Callable[[], T], interrupted_line: str) -> T:
    """``work()``'s result, computed in a worker thread; what it raises (SystemExit and
    KeyboardInterrupt included) is raised here. A Ctrl-C while it runs prints
    ``interrupted_line`` on stderr and ends the process with status 130 at once.

    Called from any thread but the main one (which alone receives signals), it simply
    runs ``work()``."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    outcome: dict[str, object] = {}

    def worker() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # handed to the main thread, which raises it
            outcome["error"] = e

    # A daemon thread: the process may end while the worker is still inside torch.
    thread = threading.Thread(target=worker, name="gemmconv-command", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(_POLL_SECONDS)
    except KeyboardInterrupt:
        _exit_interrupted(interrupted_line)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _exit_interrupted(line: str) -> None:
    """Print ``line`` and end the process now: the worker may hold the interpreter in a
    torch call for minutes, and an ordinary exit would wait for it at shutdown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to show
            pass
    isatty = getattr(sys.stderr, "isatty", None)
    # A progress bar may be drawn on the terminal's last line: start a fresh one.
    prefix = "\n" if isatty is not None and isatty() else ""
    try:
        sys.stderr.write(f"{prefix}{line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(INTERRUPTED_EXIT_STATUS)


__all__ = ["INTERRUPTED_EXIT_STATUS", "run_interruptibly"]
