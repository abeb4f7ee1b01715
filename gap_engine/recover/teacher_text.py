"""Training text the dense model writes itself: data-free distillation text for recovery.

Recovery on a few hundred thousand tokens of two built-in texts pulls a pruned model toward
them; distilling on the dense model's own distribution keeps what the dense model could do.
LLM-QAT (Liu et al., *LLM-QAT: Data-Free Quantization Aware Training for Large Language Models*,
2023) samples its training text from the full-precision model itself: a first token, then
each next token drawn from the model's softmax at temperature 1. Here the first text token is
drawn (seeded) from a short list of common sentence openings that the tokenizer writes as one
token, so every sequence starts like a document rather than on an arbitrary word piece (LLM-QAT
found sequences from a random vocabulary token the weakest start); the rest is sampled at
temperature 1 from the nucleus of probability 0.95 (Holtzman et al., *The Curious Case of Neural
Text Degeneration*, ICLR 2020), which drops the unreliable tail that makes long samples drift
into noise.

A request is ``teacher`` or ``teacher:N`` in the list of training texts: ``N`` text tokens,
written as ``ceil(N / seq_len)`` sequences of exactly one training window each (with the BOS
token in front where the model reads one, as every window of ``data.windows`` has). Sequences
are generated in batches of :data:`BATCH` whose random draws depend only on ``(seed, batch)``,
so the text is the same whether it was written at once or resumed after a kill (on the same
machine and thread count: a float summed in another order can pick another token).

The cache's folder is its schema::

    <cache root>/teacher-text/<key>/tokens.npy     (sequences, start + seq_len) int32
                                   meta.json      key, model fingerprint, settings, shape,
                                                  sha256 of tokens.npy; written last
    <cache root>/teacher-text/<key>.partial/       batches of a generation in progress,
                                   batch-NNNNN.npy, partial.json (their sha256)

``<key>`` names the model's fingerprint and a digest of every setting that changes the text.
A checksum proves an entry whole, not that it is the text asked for, so an entry is used only
when its meta.json names this model, dtype and these settings, its tokens match their checksum
and the shape meta.json records, and that shape is the request's own (``spec.sequences`` rows of
one BOS column where the model reads one plus ``seq_len`` tokens); anything else (a file where
the entry's folder belongs included) is removed with a warning and written again, never used.
A partial batch that fails its checksum or its share of the rows is generated again.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gap_engine.core.errors import DataError, SizeLimitError
from gap_engine.core.fsutil import atomic_write_bytes, atomic_write_json, cache_root, lock_for
from gap_engine.core.limits import FORCE_HINT, LIMITS, forced
from gap_engine.core.progress import EtaClock, Hooks
from gap_engine.core.validate import read_bounded, read_json_file
from gap_engine.data.bos import Tokenizer, bos_token_id
from gap_engine.model.loaded import LoadedModel

log = logging.getLogger(__name__)

SOURCE = "teacher"  # the name of teacher-written text among the training texts
# Written in about 4.5 minutes on one thread (bench/results/recovery_tasks.md). 15 CPU-minutes of LoRA-kd
# at batch 1 read 57,600 tokens there, so each sequence comes back about twice in such a run.
DEFAULT_TOKENS = 32_768
TEMPERATURE = 1.0  # LLM-QAT samples the teacher's softmax as it is
TOP_P = 0.95  # nucleus sampling (Holtzman et al. 2020): the tail below 5% of the mass is never drawn
BATCH = 64  # sequences generated together (the unit a resume repeats): decoding 64 rows cost 10 ms a token here, 16 rows 27 ms
NUCLEUS_CANDIDATES = 1024  # most likely tokens the nucleus is looked for in before a row is sorted whole
FORMAT_VERSION = 1  # bump when the sampling rule changes: a new key, never a silent change
# Common document and sentence openings; those the tokenizer writes as one token start the sequences.
OPENINGS = (
    "The", "In", "A", "This", "It", "He", "She", "They", "We", "I", "There", "When", "After", "As", "On",
    "At", "For", "One", "His", "Her", "Its", "An", "By", "From", "During", "Although", "However", "While",
    "Many", "Some", "Most", "According", "Since", "Today", "Our", "If", "How", "What", "Each", "Born",
)  # fmt: skip
_SPEC = re.compile(r"^teacher(?::(.*))?$")
_ROOT = "teacher-text"
_TOKENS, _META, _PARTIAL = "tokens.npy", "meta.json", "partial.json"


@dataclass(frozen=True)
class TeacherTextSpec:
    """What teacher text to write; every field is part of the cache key."""

    tokens: int  # text tokens asked for (rounded up to whole sequences)
    seq_len: int  # text tokens per sequence: one training window
    seed: int  # seeds the openings and every draw
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    batch: int = BATCH  # part of the key: the batches' draws depend on it
    version: int = FORMAT_VERSION

    @property
    def sequences(self) -> int:
        return math.ceil(self.tokens / self.seq_len)

    @property
    def batches(self) -> int:
        return math.ceil(self.sequences / self.batch)


def is_teacher_source(spec: str) -> bool:
    """Whether a training-text name asks for teacher-written text (``teacher`` or ``teacher:N``)."""
    return bool(_SPEC.match(str(spec).strip()))


def parse_tokens(spec: str, force: bool = False) -> int:
    """The token count of ``teacher`` (the default) or ``teacher:N`` (``force``: past the ceiling).

    Raises:
        DataError: N is not a positive whole number. SizeLimitError: N is past the ceiling.
    """
    match = _SPEC.match(str(spec).strip())
    if match is None:
        raise DataError(f"{spec!r} is not teacher text (teacher or teacher:N)")
    if match.group(1) is None:
        return DEFAULT_TOKENS
    text = match.group(1).strip().replace("_", "")
    if not text.isdigit() or int(text) < 1:
        raise DataError(f"teacher text needs a positive whole number of tokens (teacher:N), got {spec!r}")
    tokens = int(text)
    if tokens > LIMITS.teacher_tokens and not (force or forced()):
        raise SizeLimitError(
            f"{spec} (tokens of teacher text) is above the limit of {LIMITS.teacher_tokens:,}; ask for fewer tokens, or {FORCE_HINT}"
        )
    return tokens


def normalise(spec: str, force: bool = False) -> str:
    """``teacher:N`` with the count written out (``teacher`` -> ``teacher:65536``), checked."""
    return f"{SOURCE}:{parse_tokens(spec, force)}"


def cache_key(spec: TeacherTextSpec, model_fingerprint: str, dtype: str) -> str:
    """A readable prefix (the model's fingerprint) and a digest of the settings and dtype."""
    settings = asdict(spec) | {"dtype": dtype}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return f"{model_fingerprint[:16]}-{spec.tokens}x{spec.seq_len}-{digest}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _load_npy(data: bytes) -> np.ndarray:
    array: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
    return array


# ---- the openings and one batch --------------------------------------------------------------
def opening_tokens(tokenizer: Tokenizer) -> list[int]:
    """The ids of the :data:`OPENINGS` the tokenizer writes as one token (in order, no repeats);
    where fewer than 8 are, the first token of each opening.

    Raises:
        DataError: the tokenizer writes none of them.
    """
    encoded = [list(tokenizer(word, add_special_tokens=False)["input_ids"]) for word in OPENINGS]
    single = [ids[0] for ids in encoded if len(ids) == 1]
    chosen = single if len(single) >= 8 else [ids[0] for ids in encoded if ids]
    if not chosen:
        raise DataError("the teacher's tokenizer writes none of the openings teacher text starts from")
    return list(dict.fromkeys(int(t) for t in chosen))


def nucleus_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the smallest set of
    most likely tokens whose probability reaches ``top_p`` (always at least the most likely).

    The nucleus is looked for among the :data:`NUCLEUS_CANDIDATES` most likely tokens first
    (a full sort of a 49,152-token vocabulary cost 7 ms a row here, more than the decoding step's
    forward pass); only rows whose candidates hold less than ``top_p`` are sorted whole.

    Args:
        logits: (B, V) float.
    Returns:
        (B,) int64 token ids.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    top, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)  # (B, k), most likely first
    short = top.sum(-1) < top_p  # (B,) rows whose nucleus reaches past the candidates
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for rows in (~short, short):
        if not rows.any():
            continue
        ranked, ids = (top[rows], order[rows]) if rows is not short else probs[rows].sort(dim=-1, descending=True)
        before = ranked.cumsum(-1) - ranked  # mass of the more likely tokens
        ranked = ranked.masked_fill(before >= top_p, 0.0)
        picked = torch.multinomial(ranked, 1, generator=generator)  # (b, 1); multinomial renormalises
        tokens[rows] = ids.gather(-1, picked).squeeze(-1)
    return tokens


def batch_seed(seed: int, batch: int) -> int:
    """The torch seed of one batch's draws: a function of (seed, batch) only."""
    return int.from_bytes(hashlib.sha256(f"teacher-text:{seed}:{batch}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def generate_batch(
    teacher: LoadedModel,
    spec: TeacherTextSpec,
    batch: int,
    openings: Sequence[int],
    hooks: Hooks,
    tick: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Sequences ``batch * spec.batch`` .. of the text: (b, start + seq_len) int32, b the batch's
    share of ``spec.sequences``. Cancel is polled before every token; ``tick(b)`` is told each
    token position written.

    Raises:
        CancelledError: cancelled (nothing of this batch is kept).
    """
    first = batch * spec.batch
    count = min(spec.batch, spec.sequences - first)
    device = next(teacher.model.parameters()).device
    rng = np.random.default_rng([spec.seed, batch])
    starts = torch.tensor([openings[i] for i in rng.integers(0, len(openings), size=count)], device=device)
    # A document starts after BOS where the model reads one, else after the end-of-text token
    # that separates documents in its training text (SmolLM2 began a bare "Our" with "-day").
    bos = bos_token_id(teacher.tokenizer)
    context = bos if bos is not None else teacher.tokenizer.eos_token_id
    columns = [torch.full((count,), int(context), device=device, dtype=torch.long)] if context is not None else []
    dropped = int(context is not None and bos is None)  # the separator is context, not window text
    columns.append(starts)
    generator = torch.Generator(device=device).manual_seed(batch_seed(spec.seed, batch))
    ids = torch.stack(columns, dim=1)  # (b, context + 1)
    out = teacher.model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    while len(columns) - dropped < (bos is not None) + spec.seq_len:
        hooks.check_cancelled("teacher text cancelled; it resumes from the last finished batch")
        token = nucleus_sample(out.logits[:, -1], spec.temperature, spec.top_p, generator)  # (b,)
        columns.append(token)
        if len(columns) - dropped == (bos is not None) + spec.seq_len:
            break
        out = teacher.model(input_ids=token[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        if tick is not None:
            tick(count)
    return torch.stack(columns[dropped:], dim=1).to("cpu", torch.int32).numpy()  # (b, start + seq_len)


# ---- the cache -------------------------------------------------------------------------------
def entry_dir(key: str) -> Path:
    return cache_root() / _ROOT / key


def _partial_dir(key: str) -> Path:
    folder = entry_dir(key)
    return folder.with_name(folder.name + ".partial")


def _meta(
    spec: TeacherTextSpec, key: str, fingerprint: str, dtype: str, data: bytes, shape: tuple[int, ...], seconds: float
) -> dict[str, Any]:
    return {
        "key": key,
        "model_fingerprint": fingerprint,
        "dtype": dtype,
        "spec": asdict(spec),
        "shape": list(shape),
        "tokens_sha256": _sha256(data),
        "seconds": round(seconds, 3),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def read_cached(spec: TeacherTextSpec, key: str, fingerprint: str, dtype: str, vocab: int, width: int) -> np.ndarray | None:
    """The cached text for ``key``, or None when absent. An entry written for another model or
    other settings, whose tokens fail their checksum, vocabulary or recorded shape, or whose shape
    is not the request's (``spec.sequences`` rows of ``width`` tokens), is removed with a warning
    (and None returned): it is written again, never used. So is anything that is not a folder
    where the entry's folder belongs (a file, a symbolic link)."""
    folder = entry_dir(key)
    if _discard_if_not_a_folder(folder, "teacher text cache entry"):
        return None
    if not (folder / _META).is_file():
        return None
    try:
        meta = read_json_file(folder / _META, LIMITS.metadata_bytes, f"{folder}/{_META}", DataError)
        expected = {"key": key, "model_fingerprint": fingerprint, "dtype": dtype, "spec": asdict(spec)}
        wrong = next((name for name, value in expected.items() if not isinstance(meta, dict) or meta.get(name) != value), None)
        if wrong is not None:
            raise DataError(f"it was written for another {wrong.replace('_', ' ')}")
        data = read_bounded(folder / _TOKENS, LIMITS.text_bytes, f"{folder}/{_TOKENS}", DataError)
        if _sha256(data) != meta.get("tokens_sha256"):
            raise DataError("its tokens do not match their checksum")
        tokens = _load_npy(data)
        _check_tokens(tokens, (spec.sequences, width), vocab, meta.get("shape"))
    except (DataError, ValueError, OSError) as exc:
        log.warning("teacher text cache entry %s is not usable (%s); writing it again", folder.name, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return tokens


def _discard_if_not_a_folder(path: Path, what: str) -> bool:
    """Remove ``path`` when something other than a folder of its own is there (a file, a symbolic
    link, a FIFO: a damaged entry, never written into nor followed); True when it did."""
    if not (path.is_symlink() or (path.exists() and not path.is_dir())):
        return False
    log.warning("%s %s is not a folder; removing it and writing it again", what, path.name)
    path.unlink()
    return True


def _check_tokens(tokens: np.ndarray, expected: tuple[int, int], vocab: int, shape: object | None = None) -> None:
    """DataError unless ``tokens`` are int32 of the ``expected`` (rows, width), the shape the entry
    records (when given), and inside the vocabulary."""
    if tokens.dtype != np.int32 or tokens.ndim != 2:
        raise DataError(f"its tokens have shape {tokens.shape} and type {tokens.dtype}")
    if shape is not None and list(tokens.shape) != shape:
        raise DataError(f"its tokens have shape {list(tokens.shape)}, its meta.json says {shape}")
    if tokens.shape != expected:
        raise DataError(f"it holds {tokens.shape[0]} sequences of {tokens.shape[1]} tokens; the request is {expected[0]} of {expected[1]}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise DataError(f"its tokens fall outside the vocabulary of {vocab}")


def _read_partial(key: str, spec: TeacherTextSpec, vocab: int, width: int) -> dict[int, np.ndarray]:
    """The batches a killed generation finished, each checked against its recorded checksum and
    its share of the request (rows of ``width`` tokens)."""
    folder = _partial_dir(key)
    if _discard_if_not_a_folder(folder, "interrupted teacher text"):
        return {}
    try:
        recorded = read_json_file(folder / _PARTIAL, LIMITS.metadata_bytes, f"{folder}/{_PARTIAL}", DataError)
    except DataError:
        return {}
    done: dict[int, np.ndarray] = {}
    for name, digest in recorded.items() if isinstance(recorded, dict) else []:
        try:
            batch = int(name)
            data = (folder / f"batch-{batch:05d}.npy").read_bytes()
            if not 0 <= batch < spec.batches or _sha256(data) != digest:
                raise DataError("checksum")
            tokens = _load_npy(data)
            _check_tokens(tokens, (min(spec.batch, spec.sequences - batch * spec.batch), width), vocab)
        except (DataError, ValueError, OSError):
            log.warning("teacher text: batch %s of the interrupted generation is damaged; writing it again", name)
            continue
        done[batch] = tokens
    return done


def teacher_text(teacher: LoadedModel, spec: TeacherTextSpec, hooks: Hooks) -> torch.Tensor:
    """The teacher-written text of ``spec``: from the cache, else generated (resuming the batches
    a killed or cancelled generation finished) and cached.

    Args:
        teacher: the dense model that writes it (frozen, eval mode).
        hooks: a message per batch; progress as (tokens written, tokens asked, ETA seconds);
            cancel polled before every token.
    Returns:
        (spec.sequences, start + seq_len) int64 windows, as ``data.calibration_windows`` cuts them.
    Raises:
        CancelledError: cancelled (the finished batches are kept for the next call).
    """
    dtype = str(next(teacher.model.parameters()).dtype).removeprefix("torch.")
    key, vocab = cache_key(spec, teacher.fingerprint, dtype), _vocab_size(teacher)
    width = (bos_token_id(teacher.tokenizer) is not None) + spec.seq_len  # generate_batch's columns
    with lock_for(entry_dir(key)):
        cached = read_cached(spec, key, teacher.fingerprint, dtype, vocab, width)
        if cached is not None:
            hooks.say(f"teacher text: {spec.sequences * spec.seq_len:,} tokens from the cache")
            return torch.from_numpy(cached.astype(np.int64))
        tokens = _generate(teacher, spec, key, vocab, width, hooks)
    return torch.from_numpy(tokens.astype(np.int64))


def is_cached(spec: TeacherTextSpec, model_fingerprint: str, dtype: str) -> bool:
    """Whether a finished entry for this text exists (not checked: a price, not a promise)."""
    return (entry_dir(cache_key(spec, model_fingerprint, dtype)) / _META).is_file()


def uncached_tokens(folder: Path, source: str | None, seq_len: int, seed: int, teacher: str | None, dtype: str) -> int:
    """Teacher-written tokens a recovery of the checkpoint in ``folder`` will generate: none when it
    reads no teacher text (``source`` None), or when the cache holds the text the checkpoint's
    recorded base model wrote (``teacher`` None; its fingerprint is in gap_pruned.json). A price, not a promise."""
    if source is None:
        return 0
    spec = TeacherTextSpec(tokens=parse_tokens(source), seq_len=seq_len, seed=seed)
    try:
        base = None if teacher is not None else json.loads((folder / "gap_pruned.json").read_text()).get("base_fingerprint")
    except (OSError, ValueError, AttributeError):
        base = None
    return 0 if isinstance(base, str) and is_cached(spec, base, dtype) else spec.sequences * spec.seq_len


def _vocab_size(lm: LoadedModel) -> int:
    return int(lm.model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]


def _generate(teacher: LoadedModel, spec: TeacherTextSpec, key: str, vocab: int, width: int, hooks: Hooks) -> np.ndarray:
    partial = _partial_dir(key)
    done = _read_partial(key, spec, vocab, width)
    openings = opening_tokens(teacher.tokenizer)
    total = spec.sequences * spec.seq_len
    todo = [b for b in range(spec.batches) if b not in done]
    clock = EtaClock(total_steps=sum(min(spec.batch, spec.sequences - b * spec.batch) for b in todo) * spec.seq_len)
    written = sum(len(tokens) for tokens in done.values()) * spec.seq_len
    started = time.perf_counter()
    teacher.model.eval()
    if done:
        hooks.say(f"teacher text: resuming at {written:,} of {total:,} tokens")
    recorded = {str(b): _sha256(_npy_bytes(tokens)) for b, tokens in done.items()}
    produced = 0  # tokens of the batch in flight

    def tick(count: int) -> None:
        nonlocal produced
        produced += count
        hooks.report(written + produced, total, clock.step(count))

    for batch in todo:
        hooks.say(f"teacher text: writing {written:,} of {total:,} tokens")
        produced = 0
        tokens = generate_batch(teacher, spec, batch, openings, hooks, tick)
        clock.step(len(tokens))  # the batch's first token, which no decoding step counted
        data = _npy_bytes(tokens)
        atomic_write_bytes(partial / f"batch-{batch:05d}.npy", data)
        recorded[str(batch)] = _sha256(data)
        atomic_write_json(partial / _PARTIAL, recorded)  # after the batch: a kill between them only repeats it
        done[batch] = tokens
        written += len(tokens) * spec.seq_len
    tokens = np.concatenate([done[b] for b in range(spec.batches)])  # (sequences, start + seq_len)
    data = _npy_bytes(tokens)
    folder = entry_dir(key)
    atomic_write_bytes(folder / _TOKENS, data)
    fingerprint, dtype = teacher.fingerprint, str(next(teacher.model.parameters()).dtype).removeprefix("torch.")
    atomic_write_json(folder / _META, _meta(spec, key, fingerprint, dtype, data, tokens.shape, time.perf_counter() - started))
    shutil.rmtree(partial, ignore_errors=True)
    hooks.report(total, total, 0.0)
    log.info("teacher text: %d tokens written in %.0f s", total, time.perf_counter() - started)
    return tokens
