"""How a text source's documents are divided: calibration, and held-out text in two parts.

Every source (``data.windows`` reads it into documents, each with a key) is divided by document
into a *calibration* part, which loss tables, importance scores and compensation read, and a
*held-out* part, which they never see; the held-out part is divided again, by document, into a
*selection* part, on which every choice is made (a compensation, a default, "the best of"
anything), and a *report* part, on which every result is reported. The three never share a
document.

Split rule (every source): a document goes to the held-out part when the first 8 hex
digits of ``sha256(key)``, read as an integer, are divisible by 5 (so about 20%), and to
calibration otherwise. The key is the article title for ``wiki-sample`` and the
document text everywhere else, so identical documents always land on the same side.
If that leaves a side empty and there are at least two documents, the document with
the smallest hash is held out and the rest calibrate. A source with a single document
is instead cut 80/20 by characters at the paragraph or sentence boundary nearest 80%; so is
a source whose documents are all the same text (a million copies of one line): the copies
add no text, and split by the rule above every copy would land on one side.

Held-out rule (every source): the held-out keys are ordered by the next 8 hex digits of
``sha256(key)`` (bits the calibration rule never reads), and whole keys go to *selection* in
that order until it holds 3/8 of the held-out characters; the rest is *report*, never empty
when there are two keys or more. A share of the characters rather than a rule per document,
because held-out parts are small: news-sample holds 50 held-out articles (about 11,200
tokens) and a per-document coin put 12 windows of 256 tokens on one side; this rule gives 17
selection and 26-27 report windows of 256 tokens with the SmolLM2 and the Gemma 3 tokenizer,
wiki-sample 265-276 and 385-400. Held-out text of one key (a source cut by characters) is cut
again by characters, 3/8 and 5/8, at the boundary nearest 3/8. The calibration part and the
content hash (``fingerprint``, which loss tables are keyed by) are what they were before the
held-out text was divided: a table's cache key keeps its meaning.

Held-out-only sources (``data.sources.BUILTIN_TEXTS``, kind held-out) have no calibration part:
every document is held out and divided by the held-out rule above, and asking for their
calibration part is refused in one line (``heldout_corpus``).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gap_engine.core.config import HELDOUT_SPLITS
from gap_engine.core.errors import DataError
from gap_engine.data.sources import calibration_refusal

logger = logging.getLogger(__name__)

_HELDOUT_MODULUS = 5  # 1 in 5 hash buckets is held out: ~20%
_SINGLE_DOC_CALIBRATION_SHARE = 0.8
# Of the held-out characters, what selection gets: enough for 16 windows of 256 tokens on the
# smallest built-in source while report keeps 24 (the paired bootstrap's minimum).
_SELECTION_SHARE = 0.375


@dataclass(frozen=True)
class TextCorpus:
    """A text source divided by document into calibration and held-out parts, the held-out part
    again into selection and report parts."""

    name: str  # the spec it came from
    calibration: tuple[str, ...]  # documents for calibration
    heldout: tuple[str, ...]  # documents for evaluation, in source order; never overlaps calibration
    fingerprint: str  # sha256 hex of the content (calibration and heldout), for cache keys
    selection: tuple[str, ...]  # held-out text that choices are made on
    report: tuple[str, ...]  # held-out text that results are reported on; never overlaps selection
    heldout_only: bool = False  # a source kept for measuring only: its calibration part is refused

    def part(self, name: str) -> tuple[str, ...]:
        """The documents of one part: calibration, heldout, selection or report.

        Raises:
            DataError: an unknown part, or the calibration part of a held-out-only source.
        """
        if name not in _PARTS:
            raise DataError(f"unknown part of a text source {name!r}: choose one of {', '.join(_PARTS)}")
        if name == "calibration" and self.heldout_only:
            raise DataError(calibration_refusal(self.name) or f"text source {self.name!r} is held-out text only, never calibration text")
        return tuple(getattr(self, name))


_PARTS = ("calibration", "heldout", *HELDOUT_SPLITS)


def _split_bucket(key: str) -> int:
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16)


def _selection_order(key: str) -> int:
    """Where a held-out key stands in the queue for the selection part: hash digits the
    calibration rule (``_split_bucket``) never reads, so the two splits are independent."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[8:16], 16)


def make_corpus(name: str, keyed_docs: Sequence[tuple[str, str]]) -> TextCorpus:
    """Split (key, document) pairs by the module's hash rule, keeping source order."""
    if not keyed_docs:
        raise DataError(f"text source {name!r} contains no documents")
    if len({key for key, _ in keyed_docs}) == 1:
        if len(keyed_docs) > 1:  # copies of one text: either side alone would hold all of it
            logger.info("text source %s holds %d copies of one document: it is read as that one document", name, len(keyed_docs))
        return cut_corpus(name, keyed_docs[0][1])
    buckets = [_split_bucket(key) for key, _ in keyed_docs]
    is_heldout = [bucket % _HELDOUT_MODULUS == 0 for bucket in buckets]
    if all(is_heldout) or not any(is_heldout):
        smallest = min(range(len(buckets)), key=buckets.__getitem__)
        smallest_key = keyed_docs[smallest][0]
        is_heldout = [key == smallest_key for key, _ in keyed_docs]
    calibration = tuple(doc for (_, doc), held in zip(keyed_docs, is_heldout) if not held)
    heldout_keyed = [pair for pair, held in zip(keyed_docs, is_heldout) if held]
    heldout = tuple(doc for _, doc in heldout_keyed)
    selection, report = split_heldout(heldout_keyed)
    return TextCorpus(name, calibration, heldout, content_fingerprint(calibration, heldout), selection, report)


def heldout_corpus(name: str, keyed_docs: Sequence[tuple[str, str]]) -> TextCorpus:
    """A held-out-only source: every (key, document) pair held out, divided into selection and
    report by the held-out rule, keeping source order; no calibration part."""
    if not keyed_docs:
        raise DataError(f"text source {name!r} contains no documents")
    heldout = tuple(doc for _, doc in keyed_docs)
    selection, report = split_heldout(keyed_docs)
    return TextCorpus(name, (), heldout, content_fingerprint((), heldout), selection, report, heldout_only=True)


def cut_corpus(name: str, text: str) -> TextCorpus:
    """The corpus of a source with one document: cut by characters into calibration and
    held-out text, the held-out text again into selection and report."""
    calibration, heldout = _split_single_document(text)
    selection, report = split_heldout([(doc, doc) for doc in heldout])
    return TextCorpus(name, calibration, heldout, content_fingerprint(calibration, heldout), selection, report)


def split_heldout(keyed_docs: Sequence[tuple[str, str]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(selection, report) of held-out (key, document) pairs by the module's held-out rule,
    keeping source order within each part; every document of one key lands in one part."""
    chars: dict[str, int] = {}
    for key, doc in keyed_docs:
        chars[key] = chars.get(key, 0) + len(doc)
    if not chars:
        return (), ()
    if len(chars) == 1:  # one text (or copies of it): cut by characters
        return _split_single_document(keyed_docs[0][1], _SELECTION_SHARE, _SELECTION_SHARE / 2, (1 + _SELECTION_SHARE) / 2)
    queue = sorted(chars, key=lambda key: (_selection_order(key), key))
    target, filled, selected = _SELECTION_SHARE * sum(chars.values()), 0, set()
    for key in queue[:-1]:  # the last key always reports: report is never empty
        if filled >= target:
            break
        selected.add(key)
        filled += chars[key]
    selection = tuple(doc for key, doc in keyed_docs if key in selected)
    report = tuple(doc for key, doc in keyed_docs if key not in selected)
    return selection, report


def _split_single_document(
    text: str, share: float = _SINGLE_DOC_CALIBRATION_SHARE, low_share: float = 0.5, high_share: float | None = None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Cut one document at the paragraph, sentence or word boundary nearest ``share`` of its
    characters (~80/20 by default), the cut between ``low_share`` and ``high_share`` (default:
    5% before the end) of them: (first part,), (the rest,)."""
    text = text.strip()
    target = int(len(text) * share)
    low = int(len(text) * low_share)
    high = len(text) - max(1, len(text) // 20) if high_share is None else int(len(text) * high_share)
    cut = None
    for boundary in (r"\n\s*\n", r"\n", r"(?<=[.!?])[\"')\]]*\s+", r"\s+"):
        cut = _nearest_boundary(re.compile(boundary), text, target, low, high)
        if cut is not None:
            break
    if cut is None:
        cut = target
    calibration, heldout = text[:cut].strip(), text[cut:].strip()
    if not calibration or not heldout:
        return (text,), ()
    return (calibration,), (heldout,)


_CUT_SEARCH_CHARS = 1 << 16  # how far from the 80% point a cut is looked for before the whole text


def _nearest_boundary(pattern: re.Pattern[str], text: str, target: int, low: int, high: int) -> int | None:
    """The end of the match of ``pattern`` nearest ``target`` among those ending in [low, high].

    Looked for within _CUT_SEARCH_CHARS of ``target`` first: a match there is nearer than any
    outside, and a long text is not scanned whole (a 50 MB line held a list of every space).
    """
    near_low, near_high = max(low, target - _CUT_SEARCH_CHARS), min(high, target + _CUT_SEARCH_CHARS)
    # (range, where the scan starts): a match that ends in the range may start before it.
    for (start, end), scan_from in (((near_low, near_high), max(0, near_low - _CUT_SEARCH_CHARS)), ((low, high), 0)):
        # endpos one past the range: a match it truncates ends there and is left out.
        stop = min(end + 1, len(text))
        best = None
        for match in pattern.finditer(text, scan_from, stop):
            position = match.end()
            if start <= position <= end and (best is None or abs(position - target) < abs(best - target)):
                best = position
        if best is not None:
            return best
    return None


def content_fingerprint(calibration: Sequence[str], heldout: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for part_name, docs in (("calibration", calibration), ("heldout", heldout)):
        digest.update(part_name.encode() + b"\0" + len(docs).to_bytes(8, "little"))
        for doc in docs:
            encoded = doc.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()
