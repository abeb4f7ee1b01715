"""Quick evaluation of a (pruned) model, side by side with its dense original.

Measures, on held-out windows that never overlap the calibration text: perplexity on each
requested source, KL(dense || pruned) per token and top-1 agreement on the same tokens,
parameter count and size, prefill and decode throughput timed against the dense model in
the same run (interleaved, repeated: a median ratio and its spread), and greedy generations from
a few fixed prompts.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gap_engine.core.config import DEFAULT_HELDOUT_SPLIT, EVAL_WINDOWS, WindowSpec
from gap_engine.core.device import input_device, is_streamed, placement_of, synchronize
from gap_engine.core.errors import DataError, GapError
from gap_engine.core.progress import NO_HOOKS, Hooks
from gap_engine.data.bos import text_start, window_start
from gap_engine.data.windows import heldout_windows
from gap_engine.evaluate import dense_numbers
from gap_engine.model.finite import check_finite
from gap_engine.model.layerwise import logits_batches
from gap_engine.model.loaded import LoadedModel

log = logging.getLogger(__name__)

MAX_LOG_PERPLEXITY = 700.0  # math.exp overflows a float64 just past 709
THROUGHPUT_REPEATS = 5  # timed repeats per model; the speedup is their median ratio

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Photosynthesis is the process by which",
    "In 1969, the first astronauts",
)


@dataclass
class EvalSettings:
    windows: WindowSpec = EVAL_WINDOWS  # held-out windows; ``data`` may name several sources, comma-separated
    throughput: bool = True  # time prefill/decode
    generations: int = 3  # greedy generations (0 = none)
    max_new_tokens: int = 24  # per generation


@dataclass
class EvalReport:
    model: str
    params: int
    size_bytes: int
    perplexity: dict[str, float]  # source -> held-out perplexity
    dense: dict[str, Any] | None = None  # the same numbers for the dense model, when one was given
    kl_to_dense: dict[str, float] = field(default_factory=dict)  # source -> mean KL(dense || model) per token
    top1_agreement: dict[str, float] = field(default_factory=dict)  # source -> share of tokens with the same argmax
    throughput: dict[str, Any] | None = None  # prefill/decode tokens per second, model and dense, and ratios
    generations: list[dict[str, Any]] = field(default_factory=list)  # prompt, model text, dense text
    settings: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    window_start: str = "text"  # "bos": every window starts with the model's BOS token (never scored); "text": with text
    task_accuracy: dict[str, dict[str, Any]] = field(default_factory=dict)  # lm-eval task -> acc, acc_norm, stderrs, n (``tasks``)
    dense_task_accuracy: dict[str, dict[str, Any]] = field(default_factory=dict)  # the same for the dense model (cached per model + task)
    compensation: str = "none"  # what a checkpoint's kept units got after the cut (its gap_pruned.json); "none" otherwise
    # source -> PairedWindows.to_dict(): the numbers of each window, so two runs on the same windows compare with an interval
    per_window: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def mean_nll(lm: LoadedModel, windows: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token negative log-likelihood over all windows (nats per token).

    Counts the text tokens that have text before them: a leading BOS token
    (``data.bos.text_start``) is context only, never a target nor the sole context.
    """
    start = text_start(lm.tokenizer, windows)
    total, count = 0.0, 0
    for batch, logits in logits_batches(lm, windows, batch_size):
        logits = logits[:, start:-1]  # (B, T-1-start, V)
        targets = batch[:, start + 1 :]  # (B, T-1-start)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
        total += nll.item()
        count += targets.numel()
    return total / count


def perplexity(lm: LoadedModel, windows: torch.Tensor, batch_size: int = 4) -> float:
    return math.exp(mean_nll(lm, windows, batch_size))


def measured_perplexity(nll: float, lm: LoadedModel, source: str) -> float:
    """exp(``nll``) as a reported perplexity: GapError (one line, naming the cause) when the mean
    NLL is not a number or its perplexity overflows a float, never a printed ``nan``."""
    check_finite(nll, f"the mean NLL of {lm.name} on {source}", lm.model, GapError)
    if nll > MAX_LOG_PERPLEXITY:
        raise GapError(f"the mean NLL of {lm.name} on {source} is {nll:.4g} nats per token: its perplexity is past any float")
    return math.exp(nll)


@dataclass(frozen=True)
class PairedWindows:
    """A model's and its dense original's numbers on each held-out window (one entry per window,
    in window order): what a paired bootstrap between two runs on the same windows resamples."""

    nll: list[float]  # the model's mean NLL per counted token
    dense_nll: list[float]  # the dense model's
    kl: list[float]  # mean KL(dense || model) per counted token
    top1: list[float]  # share of counted positions where the two argmaxes agree

    def to_dict(self) -> dict[str, list[float]]:
        return asdict(self)


@torch.inference_mode()
def compare_windows(lm: LoadedModel, dense: LoadedModel, windows: torch.Tensor, batch_size: int = 4) -> PairedWindows:
    """Per window: model NLL, dense NLL, mean KL(dense || model) per token and top-1 agreement.

    Every window counts the same positions (those ``mean_nll`` counts: a leading BOS position is
    skipped), so the mean over windows of each is its mean over tokens.
    """
    start = text_start(lm.tokenizer, windows)
    nll_m: list[float] = []
    nll_d: list[float] = []
    kl: list[float] = []
    agree: list[float] = []
    for (batch, logits_m), (_, logits_d) in zip(logits_batches(lm, windows, batch_size), logits_batches(dense, windows, batch_size)):
        logp_m = F.log_softmax(logits_m[:, start:-1].float(), -1)  # (B, P, V)
        logp_d = F.log_softmax(logits_d[:, start:-1].float(), -1).to(logp_m.device)
        targets = batch[:, start + 1 :].to(logp_m.device)  # (B, P)
        nll_m += (-logp_m.gather(-1, targets[..., None])[..., 0].double().mean(-1)).tolist()  # (B,)
        nll_d += (-logp_d.gather(-1, targets[..., None])[..., 0].double().mean(-1)).tolist()
        kl += (logp_d.exp() * (logp_d - logp_m)).sum(-1).double().mean(-1).tolist()
        agree += (logp_m.argmax(-1) == logp_d.argmax(-1)).double().mean(-1).tolist()
    return PairedWindows(nll_m, nll_d, kl, agree)


def compare_logits(lm: LoadedModel, dense: LoadedModel, windows: torch.Tensor, batch_size: int = 4) -> tuple[float, float, float, float]:
    """(model NLL, dense NLL, mean KL(dense || model) per token, top-1 agreement) on the same tokens:
    the means over windows of `compare_windows`."""
    paired = compare_windows(lm, dense, windows, batch_size)
    return tuple(math.fsum(values) / len(values) for values in (paired.nll, paired.dense_nll, paired.kl, paired.top1))  # type: ignore[return-value]


@torch.inference_mode()
def _time_prefill(lm: LoadedModel, ids: torch.Tensor) -> float:
    ids = ids.to(input_device(lm.model))
    start = time.perf_counter()
    lm.model(input_ids=ids, use_cache=False)
    synchronize(ids.device)
    return time.perf_counter() - start


@torch.inference_mode()
def _time_decode(lm: LoadedModel, ids: torch.Tensor, new_tokens: int) -> float:
    ids = ids.to(input_device(lm.model))
    start = time.perf_counter()
    lm.model.generate(  # type: ignore[operator]  # a *ForCausalLM's generate; LoadedModel.model is typed as a Module
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id
    )
    synchronize(ids.device)
    return time.perf_counter() - start


def measure_throughput(
    lm: LoadedModel,
    dense: LoadedModel | None,
    prompt_len: int = 128,
    batch: int = 4,
    new_tokens: int = 16,
    repeats: int = THROUGHPUT_REPEATS,
) -> dict[str, Any]:
    """Prefill and decode tokens/s of the model and, interleaved with it, of dense.

    Each repeat times both models back to back (the order alternates between repeats, so a
    slow drift of the machine hits both alike) and gives one pruned/dense speed ratio; the
    ratios' median is the speedup and their range its spread. On a shared machine one
    repeat can be off by tens of percent; the spread says how far to trust the median.

    Returns:
        ``{model,dense}_{prefill,decode}_tokens_per_s`` (medians), ``prefill_speedup`` and
        ``decode_speedup`` (median ratios), ``*_speedup_range`` ([lowest, highest] ratio),
        ``*_speedup_repeats`` (every ratio) and the settings.
    """
    vocab = min(lm.tokenizer.vocab_size, 1000)
    ids = torch.randint(10, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    models = {"model": lm} if dense is None else {"model": lm, "dense": dense}
    times: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in models}
    for m in models.values():  # warm-up
        _time_prefill(m, ids[:, :16])
    for repeat in range(repeats):
        order = list(models.items())
        for name, m in order if repeat % 2 == 0 else order[::-1]:
            times[name]["prefill"].append(_time_prefill(m, ids))
            times[name]["decode"].append(_time_decode(m, ids[:1, :16], new_tokens))
    tokens = {"prefill": batch * prompt_len, "decode": new_tokens}
    out: dict[str, Any] = {
        f"{name}_{kind}_tokens_per_s": tokens[kind] / statistics.median(seconds)
        for name, kinds in times.items()
        for kind, seconds in kinds.items()
    }
    if dense is not None:
        for kind in ("prefill", "decode"):
            ratios = [d / m for m, d in zip(times["model"][kind], times["dense"][kind])]  # pruned speed / dense speed
            out[f"{kind}_speedup"] = statistics.median(ratios)
            out[f"{kind}_speedup_range"] = [min(ratios), max(ratios)]
            out[f"{kind}_speedup_repeats"] = ratios
    out["settings"] = {"prompt_len": prompt_len, "batch": batch, "new_tokens": new_tokens, "repeats": repeats}
    return out


@torch.inference_mode()
def generate(lm: LoadedModel, prompt: str, max_new_tokens: int = 24) -> str:
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids.to(input_device(lm.model))
    out = lm.model.generate(  # type: ignore[operator]  # a *ForCausalLM's generate; LoadedModel.model is typed as a Module
        ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id
    )
    text: str = lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return text


def evaluate(
    lm: LoadedModel,
    dense: LoadedModel | None = None,
    settings: EvalSettings | None = None,
    hooks: Hooks = NO_HOOKS,
) -> EvalReport:
    """Evaluate ``lm`` (and compare with ``dense`` when given) on held-out text.

    Args:
        lm: the model to evaluate, usually pruned.
        dense: its dense original, for KL, agreement, throughput ratios and generations side by side.
        settings: what to measure; defaults to EvalSettings().
        hooks: its message is told a short description of each step (logged when it has none).
    Returns:
        EvalReport (``to_dict()`` is JSON-ready).
    """
    settings = settings or EvalSettings()
    try:
        settings.windows.validate()
    except DataError as exc:
        raise GapError(f"evaluation: {exc}") from None
    say = hooks.say if hooks.message is not None else log.info
    started = time.perf_counter()
    report = EvalReport(model=lm.name, params=lm.param_count(), size_bytes=lm.size_bytes(), perplexity={})
    report.compensation = str(((lm.pruned_from or {}).get("compensation") or {}).get("mode") or "none")
    dense_perplexity: dict[str, float] = {}
    if dense is not None:
        report.dense = {
            "model": dense.name,
            "params": dense.param_count(),
            "size_bytes": dense.size_bytes(),
            "perplexity": dense_perplexity,
        }
    batch_size = settings.windows.batch_size
    for source in settings.windows.sources():
        say(f"perplexity on {source}")
        windows = heldout_windows(lm.tokenizer, settings.windows.for_source(source))
        if dense is None:
            report.perplexity[source] = measured_perplexity(mean_nll(lm, windows, batch_size), lm, source)
            continue
        paired = compare_windows(lm, dense, windows, batch_size)
        report.per_window[source] = paired.to_dict()
        nll_m, nll_d, kl, agree = (math.fsum(v) / len(v) for v in (paired.nll, paired.dense_nll, paired.kl, paired.top1))
        report.perplexity[source] = measured_perplexity(nll_m, lm, source)
        dense_perplexity[source] = dense_numbers.dense_perplexity(  # one value on every page
            dense.fingerprint, windows, measured_perplexity(nll_d, dense, source), str(placement_of(dense).dtype).removeprefix("torch.")
        )
        report.kl_to_dense[source] = check_finite(kl, f"the KL of {lm.name} to dense on {source}", lm.model, GapError)
        report.top1_agreement[source] = agree
    streamed = is_streamed(lm) or (dense is not None and is_streamed(dense))
    if streamed and (settings.throughput or settings.generations):
        say("throughput and generations are skipped: a streamed model moves every block per token")
    if settings.throughput and not streamed:
        say("throughput")
        report.throughput = measure_throughput(lm, dense)
    for prompt in DEFAULT_PROMPTS[: 0 if streamed else settings.generations]:
        say(f"generating: {prompt!r}")
        row = {"prompt": prompt, "model": generate(lm, prompt, settings.max_new_tokens)}
        if dense is not None:
            row["dense"] = generate(dense, prompt, settings.max_new_tokens)
        report.generations.append(row)
    report.settings = asdict(settings) | {"placement": placement_of(lm).describe(), "heldout_split": DEFAULT_HELDOUT_SPLIT}
    report.window_start = window_start(lm.tokenizer)
    report.seconds = time.perf_counter() - started
    return report
