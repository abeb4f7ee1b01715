"""Task accuracy through EleutherAI's lm-evaluation-harness, the number pruning papers report.

GAP, LLM-Pruner, FLAP, SliceGPT and Minitron report zero-shot accuracy on multiple-choice
tasks computed with lm-eval beside perplexity. This module runs lm-eval in-process through its
Hugging Face backend (``HFLM``) wrapped around the model the engine already loaded, so the
device, dtype, streaming and device-map placement stay as the user chose them; the prompts,
the scoring and the statistics are lm-eval's own, so the numbers equal those of
``lm_eval --model hf --model_args pretrained=FOLDER`` for the same task and limit.

Two steps, so that every mistake is found before a model loads:

* :func:`prepare_tasks` resolves the names (the offline task ``gap_wiki_next``, the YAMLs of an
  ``--include-path`` the user names, lm-eval's registered names), checks each task's kind and
  its local data files, and loads the data sets (the hub only when it answers; else its cache).
* :func:`run_tasks` scores a model on them; :func:`dense_task_scores` gives the dense model's
  scores from the cache, measuring them once per model, dtype, task, limit and shot count.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from gap_engine.core import hub
from gap_engine.core.errors import GapError, first_line
from gap_engine.core.fsutil import atomic_write_json, cache_root
from gap_engine.core.limits import LIMITS, check_at_most
from gap_engine.core.validate import read_bounded
from gap_engine.data.next_sentence import OFFLINE_TASK, offline_task_dir

log = logging.getLogger(__name__)

SUPPORTED_OUTPUT_TYPES = ("multiple_choice", "loglikelihood")  # scored by likelihood: acc (and acc_norm)
HUB_PROBE_SECONDS = 2.0  # an unreachable hub is said in one line within this, not after a hang
_LOCAL_BUILDERS = ("json", "csv", "text", "parquet")  # datasets builders that read data_files from disk
_OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
TASK_BATCH = 8  # requests per forward pass (``task_settings``'s default, the explorer's)


class TaskError(GapError):
    """A task that cannot be evaluated: unknown, of an unsupported kind, or with bad data."""


@dataclass(frozen=True)
class TaskSettings:
    """What to evaluate and how (the ``gap eval --tasks`` options)."""

    tasks: tuple[str, ...] = (OFFLINE_TASK,)  # lm-eval task names
    limit: int | None = None  # examples per task (None: all)
    num_fewshot: int | None = None  # None: the task's own default (0 when it has none)
    batch_size: int = 8  # requests per forward pass
    include_path: str | None = None  # a folder of lm-eval task YAMLs the user names

    def validate(self) -> TaskSettings:
        if not self.tasks or any(not name.strip() for name in self.tasks):
            raise TaskError("--tasks needs at least one task name, comma-separated")
        if self.limit is not None and self.limit <= 0:
            raise TaskError(f"--limit must be a positive number of examples, got {self.limit}")
        if self.num_fewshot is not None and not 0 <= self.num_fewshot <= 64:
            raise TaskError(f"--num-fewshot must be between 0 and 64, got {self.num_fewshot}")
        if self.batch_size < 1:
            raise TaskError(f"--batch-size must be at least 1, got {self.batch_size}")
        check_at_most(self.batch_size, LIMITS.batch_size, "--batch-size")
        return self


DEMO_LIMIT = 20  # examples per task where a demo should stay quick (the explorer's default)


def task_settings(
    names: str | Sequence[str],
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = TASK_BATCH,
    include_path: str | None = None,
) -> TaskSettings:
    """Validated TaskSettings from what a user typed or picked: names comma-separated or a list
    (blanks dropped, repeats kept once), a blank include path read as none. ``--tasks`` of the CLI
    and the explorer's task picker both come through here, so both refuse the same things.

    Raises:
        TaskError: no task name, a limit or shot count out of range.
    """
    parts = names.split(",") if isinstance(names, str) else [part for name in names for part in str(name).split(",")]
    cleaned = tuple(dict.fromkeys(part.strip() for part in parts if part.strip()))
    folder = include_path.strip() if isinstance(include_path, str) else include_path
    return TaskSettings(cleaned, limit, num_fewshot, batch_size, folder or None).validate()


def check_tasks(settings: TaskSettings) -> list[str]:
    """Every check of :func:`prepare_tasks` that needs no data set loaded: the names resolve
    (the offline task, the include path's YAMLs, lm-eval's registry), each task's kind, its
    local data files, and a hub data set that an unreachable hub would have to give. About a
    second, so a form can refuse a mistake before it starts a job.

    Returns:
        The task names, as resolved.
    Raises:
        TaskError: the first problem, in one line.
    """
    settings = settings.validate()
    _precheck(_manager(settings), settings)
    return list(settings.tasks)


@dataclass
class TaskScore:
    """One task's accuracy as lm-eval computed it."""

    task: str
    acc: float
    acc_stderr: float | None
    acc_norm: float | None  # None when the task has no length-normalised accuracy
    acc_norm_stderr: float | None
    n: int  # examples scored
    num_fewshot: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PreparedTasks:
    """Tasks resolved, checked and loaded (lm-eval Task objects), ready to score any model."""

    settings: TaskSettings
    manager: object  # lm_eval.tasks.TaskManager that resolved them
    tasks: dict  # leaf task name -> lm_eval Task
    fingerprints: dict[str, str]  # leaf task name -> hash of its config and local data


# ---- the hub --------------------------------------------------------------------------------
def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout`` seconds.

    Offline flags already set say no at once; the lookup runs in a daemon thread so a DNS
    resolver that hangs cannot hold the caller past ``timeout``.
    """
    if any(os.environ.get(flag, "").upper() in ("1", "ON", "YES", "TRUE") for flag in _OFFLINE_FLAGS):
        return False
    return hub.accepts_connection(timeout)


# ---- resolving and checking -------------------------------------------------------------------
def _include_dirs(settings: TaskSettings) -> list[Path]:
    """The folders lm-eval may read task YAMLs from: the offline task's, and the user's."""
    dirs = [offline_task_dir()] if OFFLINE_TASK in settings.tasks else []
    if settings.include_path is not None:
        folder = Path(settings.include_path)
        if not folder.is_dir():
            raise TaskError(f"--include-path {folder} is not a folder")
        if not any(p.suffix in (".yaml", ".yml") for p in folder.rglob("*") if p.is_file()):
            raise TaskError(f"--include-path {folder} holds no task YAML (.yaml/.yml)")
        dirs.append(folder)
    return dirs


def _manager(settings: TaskSettings):
    """A TaskManager over the named folders; lm-eval's registered tasks only when a name needs them.

    Indexing lm-eval's ~15,000 registered names takes 10-20 s on two cores, so it is done only
    when a requested name is in none of the named folders.
    """
    from lm_eval.tasks import TaskManager

    dirs = _include_dirs(settings)
    for name in settings.tasks:
        if "/" in name or name.endswith((".yaml", ".yml")):
            raise TaskError(f"task {name!r} is a path; name a folder with --include-path and the task by its name")
    manager = TaskManager(include_path=[str(d) for d in dirs] or None, include_defaults=False)
    missing = [name for name in settings.tasks if name not in manager.all_tasks]
    if not missing:
        return manager
    registry = {name: _registry_dirs(name) for name in missing}
    unknown = [name for name in missing if not registry[name]]
    if not unknown:
        _refuse_uncached_hub_tasks(missing, registry)
        # Index only the registry folders that name them (outermost ones: nested ones would be read twice).
        found = {d for dirs_found in registry.values() for d in dirs_found}
        narrowed = sorted(str(d) for d in found if not any(parent in found for parent in d.parents))
        manager = TaskManager(include_path=[str(d) for d in dirs] + narrowed, include_defaults=False)
        if any(name not in manager.all_tasks for name in settings.tasks):
            manager = TaskManager(include_path=[str(d) for d in dirs] or None, include_defaults=True)
        unknown = [name for name in settings.tasks if name not in manager.all_tasks]
    if unknown:
        where = f"the YAMLs under {settings.include_path}" if settings.include_path else "no --include-path given"
        raise TaskError(
            f"unknown task {unknown[0]!r}: not {OFFLINE_TASK}, not in {where}, and not one of lm-eval's "
            "registered names (`lm_eval ls tasks` lists them)"
        )
    return manager


def _refuse_uncached_hub_tasks(names: list[str], registry: dict[str, set[Path]]) -> None:
    """TaskError at once for a registered task whose data set only the hub has, when the hub does
    not answer: found from the one YAML that defines it, before lm-eval indexes anything."""
    if not names or hub_reachable():
        return
    from lm_eval.tasks._yaml_loader import load_yaml

    for name in names:
        pattern = re.compile(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*$", re.MULTILINE)
        for folder in sorted(registry[name]):
            for path in sorted(folder.glob("*.yaml")):
                if not pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                    continue
                try:
                    dataset = load_yaml(path, resolve_func=False).get("dataset_path")
                except Exception:  # lm-eval's loader: let the full load report it
                    return
                if isinstance(dataset, str) and dataset not in _LOCAL_BUILDERS and not hub.dataset_cached(dataset):
                    raise _load_failure(name, False, None)


def _registry_dirs(name: str) -> set[Path]:
    """The folders of lm-eval's own task YAMLs that contain ``name`` (a raw scan, 30x faster than indexing).

    Every registered task, group and tag is named in one of those files, so a name none of them
    contains is unknown without building the index.
    """
    import lm_eval

    needle = name.encode("utf-8")
    return {path.parent for path in (Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml") if needle in path.read_bytes()}


def _check_data_files(name: str, config: dict) -> None:
    """Every local data file a task names exists, fits the text ceiling and (JSON) parses."""
    kwargs = config.get("dataset_kwargs") or {}
    data_files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if config.get("dataset_path") not in _LOCAL_BUILDERS:
        return
    if not data_files:
        raise TaskError(f"task {name!r} reads dataset_path {config['dataset_path']!r} but names no dataset_kwargs.data_files")
    files = data_files.values() if isinstance(data_files, dict) else [data_files]
    for entry in files:
        for path in [entry] if isinstance(entry, str) else list(entry):
            path = Path(str(path)).expanduser()
            data = read_bounded(path, LIMITS.text_bytes, f"task {name!r} data file {path}", TaskError)
            if config["dataset_path"] == "json":
                _check_json_lines(name, path, data)


def _check_json_lines(name: str, path: Path, data: bytes) -> None:
    try:
        text = data.decode("utf-8")
        stripped = text.lstrip()
        if stripped.startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (UnicodeDecodeError, ValueError) as exc:
        raise TaskError(f"task {name!r} data file {path} is not valid JSON lines: {first_line(exc)}") from None
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise TaskError(f"task {name!r} data file {path} must hold JSON objects, one per line")


def _precheck(manager, settings: TaskSettings) -> set[str]:
    """Kind and local data of every requested task with a YAML of its own, before any data set loads.

    Returns:
        The requested names whose data may come from the hub (groups and Python tasks included).
    """
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    remote = set()
    for name in settings.tasks:
        entry = manager.task_index[name]
        if entry.kind != Kind.TASK or entry.yaml_path is None:
            remote.add(name)  # groups and Python tasks: checked once built
            continue
        try:
            config = load_yaml(entry.yaml_path, resolve_func=False)
        except Exception as exc:  # lm-eval's loader: YAML and include errors of any type
            raise TaskError(f"task {name!r}: cannot read {entry.yaml_path}: {first_line(exc)}") from None
        _check_kind(name, config.get("output_type", "generate_until"))
        _check_data_files(name, config)
        path = config.get("dataset_path")
        if path not in _LOCAL_BUILDERS and not (isinstance(path, str) and Path(path).exists()):
            remote.add(name)
    return remote


def _check_kind(name: str, output_type: str) -> None:
    if output_type not in SUPPORTED_OUTPUT_TYPES:
        raise TaskError(
            f"task {name!r} is a {output_type} task; supported are likelihood-scored tasks "
            f"({', '.join(SUPPORTED_OUTPUT_TYPES)}), not generation"
        )


def _fingerprint(task) -> str:
    """A hash of the task's resolved config and the bytes of its local data files."""
    digest = hashlib.sha256(json.dumps(task.dump_config(), sort_keys=True, default=str).encode())
    files = (task.config.dataset_kwargs or {}).get("data_files") or {}
    for entry in files.values() if isinstance(files, dict) else [files]:
        for path in [entry] if isinstance(entry, str) else list(entry):
            if Path(str(path)).is_file():
                digest.update(Path(str(path)).read_bytes())
    return digest.hexdigest()


def prepare_tasks(settings: TaskSettings) -> PreparedTasks:
    """Resolve, check and load the tasks ``settings`` names (no model needed).

    Raises:
        TaskError: an unknown name, a folder without YAML, a missing/malformed/oversized
            data file, a generation task, or a data set the unreachable hub would have to give.
    """
    settings = settings.validate()
    if logging.getLogger("lm_eval").level == logging.NOTSET:  # its INFO lines would bury ours
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = _manager(settings)
    remote = _precheck(manager, settings)
    online = bool(remote) and hub_reachable()
    loaded = {}
    for name in settings.tasks:
        try:
            with hub.offline(not online):
                loaded.update(manager.load([name])["tasks"])
        except GapError:
            raise
        except Exception as exc:  # datasets and lm-eval raise many types for missing data
            raise _load_failure(name, online, exc) from None
    for name, task in loaded.items():
        _check_kind(name, task.config.output_type)
    return PreparedTasks(settings, manager, loaded, {name: _fingerprint(task) for name, task in loaded.items()})


def _load_failure(name: str, online: bool, exc: Exception | None) -> TaskError:
    if not online:
        return TaskError(
            f"task {name!r} needs its data set from the Hugging Face hub, which cannot be reached (and its cache "
            "does not hold it): give a local copy instead, --include-path DIR with a task YAML whose dataset_path: json "
            "names local files"
        )
    return TaskError(
        f"task {name!r}: its data set could not be loaded: {type(exc).__name__}: {first_line(exc) if exc is not None else 'unknown'}"
    )


# ---- scoring --------------------------------------------------------------------------------
def _wrap(lm, batch_size: int):
    """lm-eval's HFLM around the already loaded model, its forward pass the engine's own.

    The engine's ``logits_batches`` runs a resident, dispatched or streamed model alike; logits
    are turned into log-probabilities in float32 whatever the model's dtype (as every
    objective of the engine is). The tokenizer is a copy: lm-eval may set its padding token.
    """
    import torch
    from lm_eval.models.huggingface import HFLM

    from gap_engine.core.device import input_device, is_streamed, placement_of
    from gap_engine.model.layerwise import logits_batches

    class LoadedModelLM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            with torch.no_grad():
                return next(iter(logits_batches(lm, inps, inps.shape[0])))[1]

    wrapped = LoadedModelLM(
        pretrained=lm.model,
        tokenizer=copy.deepcopy(lm.tokenizer),
        backend="causal",
        batch_size=batch_size,
        softmax_dtype=torch.float32,
    )
    wrapped._device = torch.device(placement_of(lm).device if is_streamed(lm) else input_device(lm.model))
    return wrapped


def run_tasks(
    lm, prepared: PreparedTasks, names: list[str] | None = None, examples: dict[str, list[int]] | None = None
) -> dict[str, TaskScore]:
    """Score ``lm`` (a LoadedModel) on the prepared tasks (or the ``names`` among them) with lm-eval:
    leaf task name -> TaskScore. ``examples``: task name -> the indices to score, in place of the
    settings' limit (lm-eval's ``samples``; recovery's selection slice)."""
    results = _evaluate(lm, prepared, names, examples, log_samples=False)
    return {name: _score(name, results) for name in results["results"] if name in prepared.tasks}


def request_loglikelihoods(lm, prepared: PreparedTasks, name: str) -> dict[int, list[float]]:
    """Every request of task ``name`` as :func:`run_tasks` scores it: example index -> the
    log-likelihood of each of its choices (of its one continuation, for a ``loglikelihood``
    task), in the task's order. What lm-eval's ``--log_samples`` records as ``resps``, so a
    run of lm-eval's own command line can be compared with gap's path request by request."""
    samples = _evaluate(lm, prepared, [name], None, log_samples=True)["samples"][name]
    return {int(sample["doc_id"]): [float(resp[0][0]) for resp in sample["resps"]] for sample in samples}


def _evaluate(lm, prepared: PreparedTasks, names: list[str] | None, examples: dict[str, list[int]] | None, log_samples: bool) -> dict:
    """lm-eval's ``simple_evaluate`` on gap's wrapper of ``lm``, with the prepared tasks' settings."""
    from lm_eval.evaluator import simple_evaluate

    settings = prepared.settings
    chosen = [prepared.tasks[n] for n in (names or list(prepared.tasks))]
    with hub.offline():  # every data set is loaded already: nothing may go to the network now
        results: dict = simple_evaluate(
            model=_wrap(lm, settings.batch_size),
            tasks=chosen,
            task_manager=prepared.manager,
            num_fewshot=settings.num_fewshot,
            limit=settings.limit if examples is None else None,
            samples=examples,
            log_samples=log_samples,
        )
    return results


def _score(name: str, results: dict) -> TaskScore:
    row = results["results"][name]

    def number(key: str) -> float | None:
        value = row.get(f"{key},none")
        return float(value) if isinstance(value, (int, float)) else None

    acc = number("acc")
    if acc is None:  # a supported (likelihood-scored) task always reports one
        raise TaskError(f"task {name!r}: lm-eval reported no accuracy for it")
    return TaskScore(
        task=name,
        acc=acc,
        acc_stderr=number("acc_stderr"),
        acc_norm=number("acc_norm"),
        acc_norm_stderr=number("acc_norm_stderr"),
        n=int(results["n-samples"][name]["effective"]),
        num_fewshot=int(results.get("n-shot", {}).get(name, 0) or 0),
    )


# ---- the dense model's numbers, measured once -----------------------------------------------
def _dense_key(fingerprint: str, dtype: str, prepared: PreparedTasks, name: str) -> str:
    import lm_eval

    settings = prepared.settings
    key = {
        "model": fingerprint,
        "dtype": dtype,
        "task": name,
        "task_fingerprint": prepared.fingerprints[name],
        "limit": settings.limit,
        "num_fewshot": settings.num_fewshot,
        "lm_eval": getattr(lm_eval, "__version__", "?"),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def dense_task_scores(
    fingerprint: str, dtype: str, prepared: PreparedTasks, measure: Callable[[list[str]], dict[str, TaskScore]] | None
) -> dict[str, TaskScore]:
    """The dense model's scores: cached ones, and ``measure(names)`` for the rest (then cached).

    Args:
        fingerprint, dtype: the dense weights and the dtype they ran in (the cache key's model part).
        measure: scores the dense model on the named tasks; None: return only what the cache holds.
    """
    folder = cache_root() / "tasks" / "dense"
    scores, missing = {}, []
    for name in prepared.tasks:
        path = folder / f"{_dense_key(fingerprint, dtype, prepared, name)}.json"
        try:
            scores[name] = TaskScore(**json.loads(read_bounded(path, LIMITS.metadata_bytes, "cached score", TaskError)))
        except (TaskError, TypeError, ValueError):
            missing.append(name)
    if missing and measure is not None:
        for name, score in measure(missing).items():
            atomic_write_json(folder / f"{_dense_key(fingerprint, dtype, prepared, name)}.json", score.to_dict())
            scores[name] = score
    return scores


def model_and_dense_scores(lm, dense, prepared: PreparedTasks) -> tuple[dict[str, TaskScore], dict[str, TaskScore]]:
    """``lm``'s scores and its dense original's (cached; measured with ``dense`` when missing).

    A dense model's own scores are recorded as the dense numbers, so evaluating it first makes
    every later evaluation of its pruned checkpoints measure only the pruned model.

    Args:
        lm: the model to score (pruned, recovered or dense).
        dense: its dense original when loaded, else None (then only cached dense scores are given).
    """
    from gap_engine.core.device import placement_of

    dtype = str(placement_of(lm).dtype).removeprefix("torch.")
    if not lm.pruned_from:  # the dense model itself: its cached numbers, or measured now and cached
        scores = dense_task_scores(lm.fingerprint, dtype, prepared, lambda names: run_tasks(lm, prepared, names))
        return scores, dict(scores)
    scores = run_tasks(lm, prepared)
    fingerprint = lm.pruned_from.get("fingerprint") or (dense.fingerprint if dense is not None else "")
    measure = (lambda names: run_tasks(dense, prepared, names)) if dense is not None else None
    return scores, dense_task_scores(fingerprint, dtype, prepared, measure) if fingerprint else {}


def task_report(lm, dense, prepared: PreparedTasks) -> dict:
    """``task_accuracy`` and ``dense_task_accuracy`` of a model pruned in memory from ``dense``
    (the ``EvalReport`` fields), the dense scores from the cache or measured once."""
    _, dense_scores = model_and_dense_scores(dense, None, prepared)
    return {
        "task_accuracy": {name: score.to_dict() for name, score in run_tasks(lm, prepared).items()},
        "dense_task_accuracy": {name: score.to_dict() for name, score in dense_scores.items()},
    }


def score_columns(scores: dict[str, TaskScore], prefix: str = "") -> dict[str, float]:
    """Flat columns for a CSV or a history row: ``acc_TASK``, ``acc_stderr_TASK``, ``acc_norm_TASK``, ...

    Args:
        prefix: e.g. "dense_" for the dense model's columns beside the pruned model's.
    """
    columns: dict[str, float] = {}
    for name, score in scores.items():
        for metric in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
            value = getattr(score, metric)
            if value is not None:
                columns[f"{prefix}{metric}_{name}"] = value
        columns[f"{prefix}n_{name}"] = score.n
    return columns


def score_text(score: dict | None, metric: str = "acc") -> str | None:
    """'0.625 ± 0.183' (a TaskScore dict's ``metric`` and its standard error), or None when absent."""
    value = (score or {}).get(metric)
    if not isinstance(value, (int, float)):
        return None
    stderr = (score or {}).get(f"{metric}_stderr")
    return f"{value:.3f}" + (f" ± {stderr:.3f}" if isinstance(stderr, (int, float)) and math.isfinite(stderr) else "")


def task_table_rows(models: Sequence[tuple[str, dict]]) -> list[dict]:
    """One row per task for a page's table: its examples, then ``<model> acc`` and (where the task
    has it) ``<model> acc_norm`` per model, each 'value ± stderr'; None where a model has no score.

    Args:
        models: (label, {task: TaskScore.to_dict()}) in column order, e.g. dense, pruned, recovered.
    """
    tasks = list(dict.fromkeys(task for _, scores in models for task in scores))
    norms = {task for _, scores in models for task, score in scores.items() if score.get("acc_norm") is not None}
    rows = []
    for task in tasks:
        row: dict = {"task": task, "examples": next((s[task].get("n") for _, s in models if task in s), None)}
        for label, scores in models:
            row[f"{label} acc"] = score_text(scores.get(task))
            if task in norms:
                row[f"{label} acc_norm"] = score_text(scores.get(task), "acc_norm")
        rows.append(row)
    return rows
