"""python -m gap_engine: the gap command line."""

import sys

from gap_engine.cli import main

sys.exit(main())
