"""bench/code_share.py: what counts as a code line, and the method's files exist in the tree it counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from code_share import METHOD, ROOT, code_lines, share

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
def test_every_method_file_exists_and_the_counts_add_up():
    missing = [path for paths in METHOD.values() for path in paths if not (ROOT / path).is_file()]
    assert not missing, f"bench/code_share.py names files that are gone: {missing}"
    counts = share(None)
    assert counts["method"] == sum(counts[part] for part in METHOD)
    assert 0 < counts["method"] < counts["engine"] < counts["repository"]
    assert share("HEAD")["engine"] > 0  # a revision is read through git, nothing checked out
