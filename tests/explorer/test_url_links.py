"""Crafted links: every query string a user can type or be sent opens the app with at
most a one-line message, never an exception on the page.

The URL is read by one strict parser (``explorer/url_state.parse_link``): whole numbers are ASCII
digits only (``"²".isdigit()`` is True and ``int("²")`` fails), a parameter that does not parse
is named in one message and ignored, and a task picker named in the link gets its other fields'
defaults. The parser is pure, so most cases are checked without a session; a few links open a
real session (AppTest, empty cache: no model loads).
"""

from __future__ import annotations

import pytest
from app_fixtures import APP, fresh_cache, texts  # noqa: F401
from streamlit.testing.v1 import AppTest

from explorer.url_state import parse_link

CRAFTED = {
    "run-superscript": {"run": "²"},
    "runs-superscript": {"runs": "1,²"},
    "eval-limit-superscript": {"eval_task_limit": "²"},
    "recovery-superscript": {"recovery": "²"},
    "eval-tasks-alone": {"eval_tasks": "gap_wiki_next"},
    "recover-tasks-off-alone": {"recover_tasks": "off"},
    "run-negative": {"run": "-3"},
    "run-huge": {"run": "9" * 40},
    "budget-nan": {"budget": "nan"},
    "allocator-unknown": {"allocator": "psychic"},
    "plan-not-a-hash": {"plan": "../../etc/passwd"},
    "table-traversal": {"table": "../../etc"},
    "limit-zero": {"recover_task_limit": "0"},
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_parameter_is_named_and_ignored(name):
    link = parse_link(CRAFTED[name])
    if name.endswith("-alone"):  # valid: the picker's other fields take their defaults
        assert not link.problems
        prefix = next(iter(CRAFTED[name])).split("_")[0] + "_"
        assert link.pickers[prefix][f"{prefix}task_limit"] > 0 and f"{prefix}task_folder" in link.pickers[prefix]
        return
    assert len(link.problems) == 1, link.problems
    key = next(iter(CRAFTED[name]))
    assert link.problems[0].startswith(key), link.problems
    assert link.run is None and link.recovery is None and link.runs == [] and link.allocator is None and link.plan is None


def test_valid_parameters_parse_to_their_values():
    link = parse_link(
        {
            "run": "12",
            "runs": "3,4",
            "recovery": "7",
            "budget": "0.25",
            "allocator": "uniform",
            "eval_task_limit": "40",
            "plan": "0123456789ab",
        }
    )
    assert (link.run, link.runs, link.recovery, link.budget, link.allocator, link.plan) == (12, [3, 4], 7, 0.25, "uniform", "0123456789ab")
    assert link.pickers["eval_"]["eval_task_limit"] == 40 and not link.problems


# Each link on the page whose own settings it names (app.py's URL sync runs on every page).
LINKS = {
    "run": (CRAFTED["run-superscript"], None),
    "limit-and-runs": (
        CRAFTED["eval-limit-superscript"] | CRAFTED["runs-superscript"] | CRAFTED["recovery-superscript"],
        "explorer/evaluate.py",
    ),
    "eval-tasks": (CRAFTED["eval-tasks-alone"], "explorer/evaluate.py"),
    "recover-tasks-off": (CRAFTED["recover-tasks-off-alone"], "explorer/recover.py"),
}


@pytest.mark.parametrize("name", list(LINKS))
def test_a_crafted_link_opens_its_page_without_an_exception(fresh_cache, name):
    query, page = LINKS[name]
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(query)
    at.run()
    if page:
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    expected = 0 if "tasks" in name else 1  # a picker's tasks alone are valid
    message = at.session_state["app_messages"].get("link")
    assert (message is not None) == bool(expected), message
    if message is not None:
        assert message[0] == "warning" and "\n" not in message[1] and message[1].startswith("Ignored from the link: ")
        assert message[1].count("=") == len(query)  # every bad parameter named
    if page is None:  # the sidebar shows it (a page that stops without a table leaves AppTest no sidebar to read)
        assert len([t for t in texts(at.sidebar.warning) if "link" in t]) == expected
