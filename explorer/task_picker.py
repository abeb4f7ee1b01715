"""The task-accuracy picker of Prune & evaluate and Recover: lm-eval tasks, examples, a local folder."""

from __future__ import annotations

import contextlib

import streamlit as st

from explorer.glossary import GLOSSARY
from explorer.messages import set_message
from gap_engine.core.errors import GapError, one_line
from gap_engine.data.next_sentence import OFFLINE_TASK
from gap_engine.evaluate.lm_eval_import import import_in_background, lm_eval_imported
from gap_engine.evaluate.tasks import DEMO_LIMIT, TaskSettings, check_tasks, task_settings


def task_defaults(prefix: str) -> dict:
    """The picker's starting values: the offline task, a few examples so a demo stays quick."""
    return {f"{prefix}tasks_on": True, f"{prefix}tasks": OFFLINE_TASK, f"{prefix}task_limit": DEMO_LIMIT, f"{prefix}task_folder": ""}


def task_examples(prefix: str) -> int:
    """Examples the picker asks lm-eval to score per model, every task's together (0: switched off);
    what the pages' time estimates price."""
    ss = st.session_state
    if not ss[f"{prefix}tasks_on"]:
        return 0
    names = [name for name in str(ss[f"{prefix}tasks"]).split(",") if name.strip()]
    return len(names) * int(ss[f"{prefix}task_limit"] or 0)


def task_picker(prefix: str) -> None:
    """Task accuracy through lm-eval: on or off, which tasks, how many examples, a local task folder."""
    st.toggle("Task accuracy (lm-eval)", key=f"{prefix}tasks_on", help=GLOSSARY["task accuracy"])
    if not st.session_state[f"{prefix}tasks_on"]:
        return
    import_in_background()  # lm-eval's first import takes seconds: done while the user reads the form
    st.text_input(
        "Tasks (comma-separated)",
        key=f"{prefix}tasks",
        help=f"{OFFLINE_TASK}: pick the true next sentence of a wiki-sample passage among four (offline, shipped). "
        "Also lm-eval's registered names (their data sets need the hub or its cache) and the tasks of the local folder below.",
    )
    c1, c2 = st.columns(2)
    c1.number_input(
        "Examples per task",
        min_value=1,
        max_value=100_000,
        step=10,
        key=f"{prefix}task_limit",
        help="A few keep a demo quick; the standard error says how far the accuracy can be trusted.",
    )
    c2.text_input(
        "Local task folder (optional)",
        key=f"{prefix}task_folder",
        help="A folder of lm-eval task YAMLs (dataset_path: json naming local files): lm-eval's --include-path.",
    )


def checked_task_settings(prefix: str, slot: str) -> tuple[bool, TaskSettings | None]:
    """(ok, the picker's TaskSettings or None when switched off), checked by the engine as ``gap eval
    --tasks`` checks them; a problem becomes the page's one error message and ok is False."""
    if not st.session_state[f"{prefix}tasks_on"]:
        return True, None
    try:
        settings = task_settings(
            st.session_state[f"{prefix}tasks"],
            limit=int(st.session_state[f"{prefix}task_limit"]),
            include_path=st.session_state[f"{prefix}task_folder"],
        )
        busy = (
            contextlib.nullcontext()
            if lm_eval_imported()
            else st.spinner("Loading lm-eval to check the tasks (first use after a server start: a few seconds) ...")
        )
        with busy:
            import_in_background().join()
            check_tasks(settings)
    except GapError as exc:
        set_message(slot, "error", one_line(exc))
        return False, None
    return True, settings
