"""gap_engine: layer-adaptive structured pruning of causal LMs (GAP, EMNLP 2025).

One package per stage or foundation, from the bottom up (docs/layout.md):
    core -> data (calibration windows) -> model (adapters, units, rate plans, checkpoints)
    -> prune (importance, surgery) -> evaluate -> tables (loss tables) -> plan (the DP front,
    baselines) -> recover -> export (GGUF, re-saving) -> pipeline (the stages strung together,
    background jobs) -> views (figures, report) -> cli.
This package never imports streamlit.
"""

import os as _os

# OpenMP threads that spin while waiting make torch many times slower on a shared 2-core
# machine (a 30-block forward measured 11 s instead of 0.7 s under load); passive waiting
# costs nothing when the machine is idle. Only effective before torch is imported.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
