"""gap_engine: layer-adaptive structured pruning of causal LMs (GAP, EMNLP 2025).

Pipeline, one module per stage:
    models (load) -> data (calibration windows) -> importance (within-layer scores)
    -> tables (loss table) -> planner (DP over a global budget) -> plan (declared rates)
    -> surgery (physical pruning) -> evaluate -> export.
This package never imports streamlit.
"""

__version__ = "0.1.0"
