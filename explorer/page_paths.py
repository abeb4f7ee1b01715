"""The app's pages, by the script path `st.navigation` and `st.page_link` take."""

from __future__ import annotations

SETUP_PAGE = "explorer/setup.py"
SENSITIVITY_PAGE = "explorer/sensitivity.py"
PLANNER_PAGE = "explorer/planner.py"
EVALUATE_PAGE = "explorer/evaluate.py"
EXPORT_PAGE = "explorer/export.py"
RECOVER_PAGE = "explorer/recover.py"
