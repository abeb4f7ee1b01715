"""The offline multiple-choice task cut from shipped text: ``gap_wiki_next``.

Zero-shot accuracy on multiple-choice tasks, computed with EleutherAI's lm-evaluation-harness,
is what pruning papers (GAP, LLM-Pruner, FLAP, SliceGPT) report beside perplexity. Their tasks
live on the dataset hub, which this project never reaches; this module writes one task from
the held-out part of ``wiki-sample`` (never seen by calibration), as an lm-eval task YAML and a
``.jsonl`` file under the cache, on first use. lm-eval then reads it like any local task
(``dataset_path: json``).

Each example is a passage of two consecutive sentences of one held-out article, and four
candidate next sentences: the one that truly follows, and three of similar length drawn from
*other* held-out articles. Every choice is deterministic: an example's seed is the SHA-256 of
its article number and position, which decides which positions become examples (the smallest
hashes), which sentences become distractors and where the true answer sits. The task measures
whether the model's likelihood prefers the coherent, on-topic continuation; it does not
measure reasoning or commonsense (distractors are off-topic, so topic cues alone go far), and
Wikipedia is in most models' pre-training text.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

from gap_engine.core.errors import DataError
from gap_engine.core.fsutil import atomic_directory, cache_root, lock_for
from gap_engine.data.windows import load_corpus

OFFLINE_TASK = "gap_wiki_next"
_SOURCE = "wiki-sample"
_FORMAT_VERSION = 1  # bump when the cutting rule changes: a new folder, never a silent change
_MAX_EXAMPLES = 500  # enough for a stderr near 2 points at 50% accuracy
_CONTEXT_SENTENCES = 2
_CHOICES = 4
_MIN_WORDS, _MAX_WORDS = 6, 45  # sentences outside this are lists, captions or run-ons
_LENGTH_RATIO = 1.35  # a distractor's word count is within this factor of the answer's
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")

_YAML = """\
# Written by gap_engine.data.next_sentence (format {version}); read by lm-eval's own task loader.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: multiple_choice
doc_to_text: passage
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: {version}
"""


def _sentences(article: str) -> list[list[str]]:
    """The article's paragraphs, each a list of its sentences (whitespace collapsed)."""
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", article):
        sentences = [" ".join(s.split()) for s in _SENTENCE_END.split(paragraph.strip())]
        paragraphs.append([s for s in sentences if s])
    return paragraphs


def _usable(sentence: str) -> bool:
    return _MIN_WORDS <= len(sentence.split()) <= _MAX_WORDS


def _seed(article: int, paragraph: int, position: int) -> int:
    digest = hashlib.sha256(f"{_FORMAT_VERSION}:{article}:{paragraph}:{position}".encode()).hexdigest()
    return int(digest[:16], 16)


def _pool_by_length(heldout) -> dict[int, list[tuple[str, frozenset[int]]]]:
    """Usable sentences by word count, each once with the articles it occurs in, in text order."""
    articles: dict[str, set[int]] = {}
    for a, article_text in enumerate(heldout):
        for sentences in _sentences(article_text):
            for sentence in sentences:
                if _usable(sentence):
                    articles.setdefault(sentence, set()).add(a)
    pool: dict[int, list[tuple[str, frozenset[int]]]] = {}
    for sentence in sorted(articles):
        pool.setdefault(len(sentence.split()), []).append((sentence, frozenset(articles[sentence])))
    return pool


def _distractors(pool, article: int, answer: str, rng: random.Random) -> list[str]:
    """Three sentences of other articles, of about the answer's length where there are enough."""
    words = len(answer.split())
    for low, high in ((words / _LENGTH_RATIO, words * _LENGTH_RATIO), (0, float("inf"))):
        candidates = [
            text
            for length in sorted(pool)
            if low <= length <= high
            for text, found_in in pool[length]
            if article not in found_in and text != answer
        ]
        if len(candidates) >= _CHOICES - 1:
            return rng.sample(candidates, _CHOICES - 1)
    raise DataError(f"the held-out part of {_SOURCE} has too few sentences for distractors")


def build_examples(heldout: tuple[str, ...] | list[str], max_examples: int = _MAX_EXAMPLES) -> list[dict]:
    """The task's examples from held-out articles (pure: the same articles give the same list).

    Returns:
        Dicts with ``passage`` (two sentences), ``choices`` (four sentences), ``label`` (the
        index of the true next sentence) and ``article`` (the held-out article's number).
    """
    candidates: list[tuple[int, int, str, str]] = []  # (seed, article, passage, answer)
    for a, article_text in enumerate(heldout):
        for p, sentences in enumerate(_sentences(article_text)):
            for i in range(_CONTEXT_SENTENCES, len(sentences)):
                context = sentences[i - _CONTEXT_SENTENCES : i]
                if _usable(sentences[i]) and all(len(s.split()) >= 3 for s in context):
                    candidates.append((_seed(a, p, i), a, " ".join(context), sentences[i]))
    if len({a for _, a, _, _ in candidates}) < 2:
        raise DataError(f"the held-out part of {_SOURCE} has too few articles for distractors from other articles")
    pool = _pool_by_length(heldout)
    examples = []
    for seed, article, passage, answer in sorted(candidates)[:max_examples]:
        rng = random.Random(seed)
        distractors = _distractors(pool, article, answer, rng)
        label = rng.randrange(_CHOICES)
        choices = distractors[:label] + [answer] + distractors[label:]
        examples.append({"passage": passage, "choices": choices, "label": label, "article": article})
    return examples


def offline_task_dir() -> Path:
    """The folder holding the offline task's YAML and data, written on first use (atomically).

    The folder name carries the format version and a hash of the held-out text, so a change
    of either writes a new folder instead of changing the task under an old name.

    Raises:
        DataError: the built-in text cannot be read.
        OutputError: the cache cannot be written.
    """
    corpus = load_corpus(_SOURCE)
    folder = cache_root() / "tasks" / f"{OFFLINE_TASK}-v{_FORMAT_VERSION}-{corpus.fingerprint[:12]}"
    yaml_file = folder / f"{OFFLINE_TASK}.yaml"
    if yaml_file.is_file():
        return folder
    with lock_for(folder):
        if yaml_file.is_file():  # another process wrote it while we waited
            return folder
        examples = build_examples(corpus.heldout)
        with atomic_directory(folder) as tmp:
            data_file = folder / f"{OFFLINE_TASK}.jsonl"
            lines = "".join(json.dumps(example, ensure_ascii=False) + "\n" for example in examples)
            (tmp / data_file.name).write_text(lines, encoding="utf-8")
            # The data file's path is a JSON string (valid YAML) so no character in it can change the YAML.
            yaml_text = _YAML.format(version=_FORMAT_VERSION, task=OFFLINE_TASK, data_file=json.dumps(str(data_file)))
            (tmp / yaml_file.name).write_text(yaml_text, encoding="utf-8")
    return folder
