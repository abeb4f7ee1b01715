"""Usenet posts as documents: the built-in held-out source ``newsgroups``.

gensim ships 200 posts of the 20 Newsgroups collection (alt.atheism and sci.space, 1993) as a
zlib-compressed pickle of a scikit-learn ``Bunch``. The pickle is never unpickled (that would
run whatever its opcodes name, and needs scikit-learn): ``pickletools.genops`` only lists its
opcodes, and a post is every string among them that starts with a Usenet header block holding
a ``Message-ID`` line.

Cleaning, so that what is measured is what the poster wrote, once:

* the header block (path, addresses, dates, up to the first blank line) is dropped; the
  ``Message-ID`` is kept as the post's key (the split's hash reads it, so a change to the
  cleaning never moves a post from one part to another), and a post seen twice (crossposted)
  is read once;
* quoted lines (``>``, ``|``, ``:``, ``#``, ``}`` or initials and ``>`` at the start) and the
  attribution lines that introduce them ("... writes:", "In article <...>") are dropped: a reply
  quotes other posts of the same collection, and the quote would put one post's words in two
  parts;
* the signature, everything after a ``--`` line, is dropped;
* the body's hard-wrapped lines are joined into paragraphs (blank lines between them), spaces
  collapsed, as every built-in source is read; a paragraph of which fewer than 60% of the
  visible characters are letters (ASCII art, tables of numbers, encoded files) is dropped;
* a post with no paragraph left is dropped.
"""

from __future__ import annotations

import pickletools
import re
import zlib
from pathlib import Path

from gap_engine.core.errors import DataError, first_line
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import read_bounded

# Pickle opcodes whose argument is text (protocol 0 writes a Python 2 unicode as UNICODE).
_TEXT_OPCODES = frozenset({"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_MESSAGE_ID = re.compile(r"^Message-ID:\s*(\S+)", re.IGNORECASE | re.MULTILINE)
_HEADER_LINE = re.compile(r"^[A-Za-z][A-Za-z0-9-]*:")
_QUOTED = re.compile(r"^\s*(?:[>|:#}]|[A-Za-z]{1,4}>)")
_ATTRIBUTION = re.compile(r"(?:writes|wrote|says|said)\s*:\s*>?\s*$|^\s*In article\b|^\s*In <[^>]*>", re.IGNORECASE)
_SIGNATURE = re.compile(r"^--\s*$")
_MIN_LETTER_SHARE = 0.6


def read_newsgroup_posts(path: Path) -> list[tuple[str, str]]:
    """(Message-ID, cleaned text) of every post in gensim's ``mini_newsgroup`` file, in file order.

    Raises:
        DataError: the file is unreadable, not zlib data, larger than a text source may be once
            inflated, or holds no post.
    """
    what = f"the newsgroup sample {path}"
    compressed = read_bounded(path, LIMITS.text_bytes, what, DataError)
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(compressed, LIMITS.text_bytes)
    except zlib.error as exc:
        raise DataError(f"could not read {what}: {first_line(exc)}") from None
    if inflater.unconsumed_tail:
        raise DataError(f"{what} inflates to more than {LIMITS.text_bytes:,} bytes")
    posts: list[tuple[str, str]] = []
    seen: set[str] = set()
    try:
        for opcode, argument, _ in pickletools.genops(raw):
            if opcode.name not in _TEXT_OPCODES or not isinstance(argument, str):
                continue
            post = clean_post(argument)
            if post is not None and post[0] not in seen:
                seen.add(post[0])
                posts.append(post)
    except (ValueError, EOFError) as exc:  # pickletools' words for a truncated or foreign stream
        raise DataError(f"could not read {what}: {first_line(exc)}") from None
    if not posts:
        raise DataError(f"{what} holds no newsgroup post")
    return posts


def clean_post(text: str) -> tuple[str, str] | None:
    """(Message-ID, the poster's own words) of one raw post; None for a string that is no post
    (no header block with a Message-ID) or a post with nothing of its own left."""
    header, _, body = text.replace("\r\n", "\n").partition("\n\n")
    if not all(_HEADER_LINE.match(line) or line[:1].isspace() for line in header.splitlines()):
        return None  # folded header lines start with a space; anything else is not a header block
    message_id = _MESSAGE_ID.search(header)
    if message_id is None:
        return None
    kept: list[str] = []
    for line in body.splitlines():
        if _SIGNATURE.match(line):
            break
        # A dropped line ends a paragraph: the words on either side were not one sentence.
        kept.append("" if _QUOTED.match(line) or _ATTRIBUTION.search(line) else line)
    paragraphs = []
    for block in re.split(r"\n\s*\n", "\n".join(kept)):
        paragraph = " ".join(block.split())
        visible = sum(not ch.isspace() for ch in paragraph)
        if visible and sum(ch.isalpha() for ch in paragraph) >= _MIN_LETTER_SHARE * visible:
            paragraphs.append(paragraph)
    return (message_id.group(1), "\n\n".join(paragraphs)) if paragraphs else None
