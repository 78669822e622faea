"""The ``gemmconv`` command (gemmconv.cli.commands)."""

from gemmconv.cli.commands import main

__all__ = ["main"]
