"""Run the gemmconv benchmark suite (the same as `gemmconv bench`).

PYTHONPATH=src python bench/run_suite.py --out bench/results          # the full suite
PYTHONPATH=src python bench/run_suite.py --device cpu --quick --out /tmp/b
"""

from __future__ import annotations

import sys

from gemmconv.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
