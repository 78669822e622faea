"""``python -m gemmconv``: the same command as ``gemmconv``."""

import sys

from gemmconv.cli import main

sys.exit(main())
