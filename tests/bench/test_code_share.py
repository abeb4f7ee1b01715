"""bench/code_share.py: what counts as a code line, and every part of the method is found in the tree it counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from code_share import METHOD, code_lines, share

SOURCE = '''"""A module docstring
over two lines."""

# a comment
import os  # a trailing comment counts its line once


def f(x):
    """A docstring."""
    return (x +
            1)
'''


def test_blank_comment_and_docstring_lines_do_not_count():
    assert code_lines(SOURCE) == 4  # import, def, and the return over two lines
    assert code_lines("x = '''not a\ndocstring'''\n") == 2  # a string that is a value is code
    assert code_lines("def broken(:\n") == 0


@pytest.mark.slow
@pytest.mark.slow  # reads every tracked file twice (the tree and HEAD through git)
def test_every_part_of_the_method_is_counted_and_the_counts_add_up():
    """A file of METHOD may be missing (one list serves revisions before and after a file moved), but no part may be empty."""
    counts = share(None)
    assert all(counts[part] > 0 for part in METHOD), {part: counts[part] for part in METHOD}
    assert counts["method"] == sum(counts[part] for part in METHOD)
    assert 0 < counts["method"] < counts["engine"] < counts["repository"]
    assert share("HEAD")["engine"] > 0  # a revision is read through git, nothing checked out
