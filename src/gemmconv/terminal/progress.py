"""Progress bars for the command line: on stderr, and only when stderr is a terminal.

A run whose stderr goes to a file or a pipe (a log, CI, a test) gets no bar at all, so
the captured output holds the results and nothing else. Lines printed while a bar is
shown go through ``bar.write``, which keeps them from tearing the bar.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Protocol

from tqdm import tqdm


class Bar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str) -> object: ...

    def write(self, s: str) -> object: ...


def stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class _NoBar:
    """What a bar's user sees when there is no terminal: lines are printed, the rest
    does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def write(self, s: str) -> None:
        print(s)


@contextlib.contextmanager
def progress_bar(total: int, desc: str, unit: str, enabled: bool = True) -> Iterator[Bar]:
    """A tqdm bar on stderr when it is a terminal (and ``enabled``), else a stand-in
    that draws nothing."""
    if not (enabled and stderr_is_terminal()):
        yield _NoBar()
        return
    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False) as bar:
        yield bar


class CallCounter:
    """A ``setup`` hook for ``gemmconv.measuring.timing.time_ms`` that advances ``bar`` by one
    call each time the next call is about to start; ``finish()`` counts the last one.

    Counting a call when the next begins, rather than when it begins, keeps the bar
    from claiming a call that is still running (one CPU call can take a minute)."""

    def __init__(self, bar: Bar) -> None:
        self._bar = bar
        self._started = False

    def __call__(self) -> None:
        if self._started:
            self._bar.update(1)
        self._started = True

    def finish(self) -> None:
        if self._started:
            self._bar.update(1)
        self._started = False


__all__ = ["Bar", "CallCounter", "progress_bar", "stderr_is_terminal"]
