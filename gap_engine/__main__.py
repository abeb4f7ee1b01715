"""python -m gap_engine: the gap command line."""

import sys

from .cli import main

sys.exit(main())
