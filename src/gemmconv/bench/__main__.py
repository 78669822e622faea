"""Run the gemmconv benchmark suite (the same as `gemmconv bench`).

PYTHONPATH=src python -m gemmconv.bench --out bench/results          # the full suite
PYTHONPATH=src python -m gemmconv.bench --device cpu --quick --out /tmp/b
"""

from __future__ import annotations

import sys

from gemmconv.bench.suite import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
