"""Checks every ``gap`` command passes before its handler (and torch) is imported.

Options first: an option that cannot apply as the command is given (``--samples`` beside
``compare --table``, whose windows are the table's; ``--rates`` beside ``prune --uniform``) is
refused, never ignored; every such rule is one row of ``OPTION_RULES``.

Then sizes: each resource-sized option has a floor (what makes sense) and a ceiling (what
the machine can hold, ``limits.LIMITS``); a value past a ceiling is refused with one line
naming the limit and the way past it (``--force-size`` or ``GAP_FORCE_SIZE=1``). Then the
output: ``--out`` must be writable, of the right kind (a folder for ``prune``, a file for
the others), and ``prune`` replaces only an empty folder or an earlier checkpoint. So a
bad value costs a fraction of a second, not a model load and a half-finished measurement.

Then the names: a ``--model`` that is neither a built-in, a path that exists, nor a hub id
(or a hub id while the hub is switched off and the model is not in the local cache), a text
source spec of no known form, a ``--max-memory`` that is not DEVICE=SIZE. And one rule for
every output: ``--out`` may not be, or lie inside, any input of the same command
(``fsutil.check_not_an_input``), so no command can overwrite what it reads.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gap_engine.core import hub
from gap_engine.core.config import HELDOUT_TEXT_NAMES
from gap_engine.core.errors import CacheError, DataError, ModelLoadError, OptionError, OutputError
from gap_engine.core.fsutil import (
    CACHE_ENV,
    cache_root,
    check_not_an_input,
    check_output,
    refuse_special_files,
    special_kind,
    user_path,
    write_refusal,
)
from gap_engine.core.limits import LIMITS, check_at_most, check_windows
from gap_engine.core.memory import parse_max_memory
from gap_engine.data.sources import calibration_refusal, mix_refusal
from gap_engine.model.identity import BUILTIN_MODEL_NAMES
from gap_engine.plan.allocator_registry import ALLOCATORS, own_criterion
from gap_engine.prune.criteria import CRITERIA, is_sequential

# option dest -> (flag, floor, ceiling field of LIMITS or None, what one unit is)
SIZE_OPTIONS: dict[str, tuple[str, int, str | None, str]] = {
    "samples": ("--samples", 1, "samples", "windows"),
    "seq_len": ("--seq-len", 2, "seq_len", "tokens per window"),
    "batch_size": ("--batch-size", 1, "batch_size", "windows per forward pass"),
    "eval_samples": ("--eval-samples", 1, "samples", "windows"),
    "eval_seq_len": ("--eval-seq-len", 2, "seq_len", "tokens per window"),
    "n_buckets": ("--n-buckets", 1, "n_buckets", "budget buckets"),
    "generations": ("--generations", 0, "generations", "generations"),
    "evo_generations": ("--evo-generations", 0, "evo_generations", "rounds"),
    "evo_offspring": ("--evo-offspring", 1, "evo_offspring", "candidates per round"),
    "channel_multiple": ("--channel-multiple", 1, "channel_multiple", "channels"),
    "rounds": ("--rounds", 1, "rounds", "rounds, each a loss table of the whole model"),
    "ray_workers": ("--ray-workers", 1, "ray_workers", "worker processes, each holding the model"),
    "seed": ("--seed", 0, "seed", ""),
    "keep_params": ("--keep-params", 1, None, "parameters"),
    "obs_samples": ("--obs-samples", 1, "samples", "windows"),
    "fit_samples": ("--fit-samples", 1, "samples", "windows"),
}
# Commands whose --out is a folder (and `export --format hf`); every other --out is a file.
FOLDER_OUTPUTS = ("prune", "recover")
# Commands that always use the on-disk cache (tables, converted models, the run history, the
# cost model's measured profile that table --dry-run writes).
CACHE_COMMANDS = ("table", "compare", "models", "cache", "recover")
# Commands that only read the cache (listing models and tables, a report of a recorded run):
# they work on a read-only one.
CACHE_READERS = ("models", "cache", "report")
# The built-in model names (model.identity names loading.BUILTIN_MODELS without torch). Loading one uses the cache.
BUILTIN_NAMES = BUILTIN_MODEL_NAMES
# Models `gap table --dry-run` prices from their published shapes alone (pipeline.cost_model.SHAPES; not
# imported: it needs torch). They are names for planning, never loaded: the handler refuses them
# for anything but a dry run.
PLANNING_SHAPES = ("llama-3.1-8b", "llama-3.1-70b")
# The file a gap checkpoint folder holds (model.checkpoint.PRUNED_MARKER; not imported: it needs torch).
CHECKPOINT_MARKER = "gap_pruned.json"
BUILTIN_TEXTS = HELDOUT_TEXT_NAMES  # every built-in (data.windows is not imported here: it needs torch)
# Commands whose --data is held-out text; every other command's --data is calibration (or training)
# text, where a held-out-only source is refused (data.sources.calibration_refusal).
HELDOUT_DATA_COMMANDS = ("eval",)
TEACHER_TEXT = re.compile(r"^teacher(:.*)?$")  # recover's teacher-written text (recover.teacher_text; not imported: it needs torch)
# A Hugging Face hub id as the hub spells them: owner/name, letters, digits, '-', '_', '.'.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# A dataset split: a name, optionally sliced as datasets allows (train[:10%]).
SPLIT = re.compile(r"^[A-Za-z0-9_.-]{1,64}(\[[0-9:%+-]{0,32}\])?$")
# How messages name the cache root: an input of every command (tables, converted models, the run history).
CACHE_INPUT = "the cache"
# Inputs read as whole folders: an output inside one changes the input.
FOLDER_INPUTS = ("--model", "the checkpoint", "--teacher", "--include-path", CACHE_INPUT)
# Where an output of each command lives besides --out (recover works in OUT.partial).
PARTIAL_SUFFIX = ".partial"


def _count(text: str | None) -> int:
    return len([part for part in str(text or "").split(",") if part.strip()])


def check_sizes(args: argparse.Namespace) -> None:
    """SizeLimitError (or DataError for a value below its floor) for any out-of-range size option."""
    force = bool(getattr(args, "force_size", False))
    for dest, (flag, floor, ceiling, unit) in SIZE_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if value < floor:
            raise DataError(f"{flag} must be at least {floor}, got {value}")
        if ceiling is not None:
            check_at_most(value, getattr(LIMITS, ceiling), f"{flag} {value:,}" + (f" ({unit})" if unit else ""), force)
    for prefix in ("", "eval_"):
        samples, seq_len = getattr(args, f"{prefix}samples", None), getattr(args, f"{prefix}seq_len", None)
        if samples is None or seq_len is None:
            continue
        flag = "--" + prefix.replace("_", "-")
        names = (f"{flag}samples", f"{flag}seq-len", "--batch-size")
        check_windows(samples, seq_len, getattr(args, "batch_size", None) or 1, names, force)
    for dest in ("obs_samples", "fit_samples"):
        if getattr(args, dest, None) is not None and getattr(args, "seq_len", None) is not None:
            names = ("--" + dest.replace("_", "-"), "--seq-len", "--batch-size")
            check_windows(getattr(args, dest), args.seq_len, getattr(args, "batch_size", None) or 1, names, force)
    if getattr(args, "rates", None) is not None:
        check_at_most(_count(args.rates), LIMITS.rates, f"--rates lists {_count(args.rates):,} rates, which", force)
    for dest, flag in (("budgets", "--budgets"), ("refine_budgets", "--refine-budgets")):
        if getattr(args, dest, None) is not None:
            check_at_most(
                _count(getattr(args, dest)), LIMITS.budgets, f"{flag} lists {_count(getattr(args, dest)):,} budgets, which", force
            )


# The options that set how a loss table is built and what it is built on (cli.arguments.spec_from_args).
TABLE_BUILD = ("rates", "objective", "mode", "estimator", "refine_budgets", "refine_attention")
TABLE_UNITS = ("criterion", "channel_multiple")  # which units a rate removes, and the MLP's width granularity
CALIBRATION = ("data", "samples", "seq_len", "batch_size")


@dataclass(frozen=True)
class OptionRule:
    """Options of ``commands`` that apply only when ``applies(args)`` holds; otherwise giving one
    is refused (``because``: when they cannot apply, and what decides instead), never ignored."""

    commands: tuple[str, ...]
    options: tuple[str, ...]  # argparse destinations
    applies: Callable[[argparse.Namespace], bool]
    because: str


def _allocator_specs(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """(allocator, criterion or "") of each ``ALLOCATOR[:CRITERION]`` the command names (compare's
    ``dp:obs``; the engine's ``pipeline.compare.allocator_spec`` judges the names)."""
    text = str(getattr(args, "allocators", None) or getattr(args, "allocator", ""))
    return tuple((allocator.strip(), criterion.strip()) for allocator, _, criterion in (part.partition(":") for part in text.split(",")))


def _allocators(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(allocator for allocator, _ in _allocator_specs(args))


def _prunes_by_obs(args: argparse.Namespace) -> bool:
    """Whether the command may prune by a sequential criterion (``obs``): ``prune --criterion obs``,
    or a ``--plan`` or ``--budget`` (whose criterion the handler reads: the plan's, or the model
    family's step), or a compare spec that names it or whose allocator prunes by it (``slimgpt``,
    ``dp`` on a family whose step is OBS)."""
    if args.command == "prune":
        return args.plan is not None or args.budget is not None or is_sequential(args.criterion)
    for allocator, criterion in _allocator_specs(args):
        if not criterion and allocator in ALLOCATORS and ALLOCATORS[allocator].family_step:
            return True  # the family's step may be OBS; the handler knows the model
        named = criterion or (own_criterion(allocator) if allocator in ALLOCATORS else None)
        if named in CRITERIA and is_sequential(str(named)):
            return True
    return False


# Every rule on options that another option or an input makes moot, in one place.
OPTION_RULES = (
    OptionRule(
        ("compare",),
        CALIBRATION + TABLE_BUILD + TABLE_UNITS,
        lambda a: a.table is None,
        "with --table: compare plans, prunes and compensates on the table's own settings and calibration windows "
        "(those its cells were measured on); leave them out, or build a table with them (gap table)",
    ),
    OptionRule(
        ("prune",),
        TABLE_BUILD + ("rounds",),
        lambda a: a.budget is not None,
        "without --budget: they set how --budget's loss tables are built, and --uniform and --plan build none",
    ),
    OptionRule(
        ("prune",),
        ("channel_multiple",),
        lambda a: a.plan is None,
        "with --plan: the plan's own channel multiple sets its widths; leave it out",
    ),
    OptionRule(
        ("prune", "compare"),
        ("obs_samples",),
        _prunes_by_obs,
        "unless a plan is pruned by the obs criterion (--criterion obs, a --plan, or an allocator such as slimgpt or dp:obs): "
        "it sizes obs's calibration windows",
    ),
    OptionRule(
        ("plan", "compare"),
        ("evo_generations", "evo_offspring"),
        lambda a: "evo" in _allocators(a),
        "without the evo allocator: they tune its search",
    ),
    OptionRule(
        ("eval", "compare"),
        ("limit", "num_fewshot", "include_path"),
        lambda a: a.tasks is not None,
        "without --tasks",
    ),
    OptionRule(
        ("recover",),
        ("force_size",),
        lambda a: any(TEACHER_TEXT.match(part.strip()) for part in str(a.data or "").split(",")),
        "without teacher text in --data: it lifts teacher text's ceilings, the only ones recover has",
    ),
    OptionRule(("table",), ("ray_workers",), lambda a: a.ray is not None, "without --ray: the cells are measured in this process"),
    OptionRule(("table",), ("profile",), lambda a: a.dry_run, "without --dry-run: a build runs on this machine, not on a spec sheet"),
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_option_rules(args: argparse.Namespace) -> None:
    """OptionError for an option given where it cannot apply (``OPTION_RULES``). Only options the
    command line gives itself count (``parser.explicit_options``): a default is never refused."""
    given: frozenset[str] = getattr(args, "given_options", frozenset())
    for rule in OPTION_RULES:
        if args.command not in rule.commands:
            continue
        moot = [_flag(dest) for dest in rule.options if dest in given]
        if moot and not rule.applies(args):
            options = ", ".join(moot[:-1]) + " and " + moot[-1] if len(moot) > 1 else moot[0]
            raise OptionError(f"gap {args.command}: {options} cannot apply {rule.because}")


def check_sources(args: argparse.Namespace) -> None:
    """DataError when --data or --eval-data names no text source (``--data ""`` measures nothing)."""
    for dest, flag in (("data", "--data"), ("eval_data", "--eval-data")):
        if getattr(args, dest, None) is not None and _count(getattr(args, dest)) == 0:  # None: the command's default
            raise DataError(f"{flag} names no text source; give wiki-sample, news-sample, a .txt/.jsonl file or an HF spec")


def _hub_host_resolves(timeout: float = 3.0) -> bool:
    """Whether the hub's host name resolves (asked once per process, at most ``timeout`` seconds).

    Without a name there is no network path to the hub: the libraries would spend a minute in
    retries and print a line for each before failing, so such names are judged here instead.
    """
    if not _HUB_RESOLVES:
        _HUB_RESOLVES.append(hub.host_resolves(timeout))
    return _HUB_RESOLVES[0]


_HUB_RESOLVES: list[bool] = []


def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be used: switched off (HF_HUB_OFFLINE,
    TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) or its host name does not resolve."""
    if hub.switched_off():
        return True
    return not _hub_host_resolves()


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return home / "hub"


def hub_cached(repo_id: str, kind: str = "models") -> bool:
    """True when the hub cache holds a snapshot of ``repo_id`` (a model or a dataset)."""
    folder = _hub_cache() / f"{kind}--{repo_id.replace('/', '--')}" / "snapshots"
    try:
        return folder.is_dir() and any(folder.iterdir())
    except OSError:
        return False


def check_model_name(name: str | None, flag: str = "--model") -> None:
    """ModelLoadError now, before any text is read, for a model that cannot be loaded.

    A built-in name and a path that exists pass (the loader checks what is inside); a
    special file (FIFO, device) is refused; a hub id passes unless the hub is switched off
    and the model is not cached; anything else is no model at all.
    """
    if name is None or name in BUILTIN_NAMES:
        return
    text = str(name)
    path = Path(text).expanduser()
    if path.exists():
        kind = special_kind(path)
        if kind:
            raise ModelLoadError(f"{flag} {text} is {kind}, not a model folder or file")
        if path.is_dir():
            refuse_special_files(path, ModelLoadError)  # a FIFO among the weights: refused before any text is read
            if not (path / "config.json").is_file() and not (path / CHECKPOINT_MARKER).is_file():
                raise ModelLoadError(f"{path} is a folder without config.json, not a model checkpoint")
        return
    if path.suffix == ".gguf":
        raise ModelLoadError(f"{flag}: GGUF file {text} does not exist")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        if not HUB_ID.match(text):
            raise ModelLoadError(f"{flag} {text!r} is not a hub id (owner/name: letters, digits, '-', '_', '.') nor a path that exists")
        if hub_offline() and not hub_cached(text):
            raise ModelLoadError(f"{flag} {text}: the Hugging Face hub is not reachable (offline) and this model is not in its local cache")
        return
    raise ModelLoadError(
        ("" if flag == "--model" else f"{flag}: ")
        + f"unknown model '{text}': not a built-in ({', '.join(BUILTIN_NAMES)}), a local model folder, a .gguf file, or a hub id 'org/name'"
    )


def check_models(args: argparse.Namespace) -> None:
    """check_model_name for --model and --teacher (and the checkpoint of ``gap export``)."""
    if args.command == "table" and getattr(args, "model", None) in PLANNING_SHAPES:
        return  # priced by --dry-run from its shape; any other use fails in the handler
    check_model_name(getattr(args, "model", None))
    check_model_name(getattr(args, "teacher", None), "--teacher")  # a named teacher that cannot load is refused, not dropped
    if args.command == "export":
        check_model_name(getattr(args, "checkpoint", None), "the checkpoint")


def check_source_spec(spec: str, flag: str) -> None:
    """DataError for a text source spec of no known form (before any text or model loads)."""
    spec = spec.strip()
    if spec in BUILTIN_TEXTS:
        return
    if spec.lower().endswith((".txt", ".jsonl")):
        path = Path(spec).expanduser()
        if not path.exists():
            raise DataError(f"{flag}: text file not found: {spec}")
        kind = special_kind(path)
        if kind or not path.is_file():
            raise DataError(
                f"{flag}: text source {spec} is {kind + ', not a regular file' if kind else 'not a regular file'}; give a .txt or .jsonl file"
            )
        return
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] and parts[2]:
        name, _, split = parts
        if not (HUB_ID.match(name) or re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$", name)):
            raise DataError(f"{flag}: {name!r} in {spec!r} is not a dataset name")
        if not SPLIT.match(split):
            raise DataError(f"{flag}: {split!r} in {spec!r} is not a dataset split (e.g. train, test, train[:10%])")
        if hub_offline() and not hub_cached(name, "datasets"):
            raise DataError(f"{flag} {spec}: the Hugging Face hub is not reachable (offline) and this dataset is not in its local cache")
        return
    raise DataError(
        f"{flag}: unknown text source {spec!r}: expected a built-in name ({', '.join(BUILTIN_TEXTS)}), a .txt or "
        ".jsonl file, or a Hugging Face dataset 'name:config:split' (e.g. wikitext:wikitext-2-raw-v1:test)"
    )


def check_source_specs(args: argparse.Namespace) -> None:
    for dest, flag in (("data", "--data"), ("eval_data", "--eval-data")):
        for part in str(getattr(args, dest, None) or "").split(","):
            if args.command == "recover" and "@" in part:
                part = part.rsplit("@", 1)[0]  # recover's SOURCE@PART: the part is recover's to judge
            if args.command == "recover" and dest == "data" and TEACHER_TEXT.match(part.strip()):
                continue  # teacher-written text: its token count is recover's to judge
            if part.strip():
                check_source_spec(part, flag)
            refusal = calibration_refusal(part) if dest == "data" and args.command not in HELDOUT_DATA_COMMANDS else None
            if refusal is not None:
                raise DataError(f"{flag}: {refusal}")
    check_calibration_mix(args)


def check_calibration_mix(args: argparse.Namespace) -> None:
    """DataError (one line) for calibration text (--data of a command whose windows calibrate)
    that names a source twice, or more sources than it reads windows (--samples, --obs-samples)."""
    if args.command in HELDOUT_DATA_COMMANDS or args.command == "recover" or getattr(args, "samples", None) is None:
        return  # recover's --data lists tasks, each its own windows
    sources = [part.strip() for part in str(getattr(args, "data", None) or "").split(",") if part.strip()]
    for flag, samples in (
        ("--samples", args.samples),
        ("--obs-samples", getattr(args, "obs_samples", None)),
        ("--fit-samples", getattr(args, "fit_samples", None)),
    ):
        refusal = None if samples is None else mix_refusal(sources, samples)
        if refusal is not None:
            raise DataError(f"--data: {refusal}" + (f" ({flag} {samples})" if flag != "--samples" else ""))


def check_max_memory(args: argparse.Namespace) -> None:
    """DataError for a --max-memory that is not DEVICE=SIZE, or --device-map beside --device or
    --stream (now, not after the text or the model loaded)."""
    if getattr(args, "max_memory", None):
        parse_max_memory(args.max_memory, DataError)
    if getattr(args, "device_map", None) and (getattr(args, "stream", False) or getattr(args, "device", "auto") != "auto"):
        raise DataError("--device-map places the model itself: leave out --device and --stream")


def _cache_path() -> Path:
    """fsutil.cache_root's path, without creating it (check_cache does, later)."""
    root = os.environ.get(CACHE_ENV)
    return Path(user_path(root, CACHE_ENV, CacheError) if root else Path(__file__).resolve().parents[2] / "cache")


# option dest -> how a message names it: every file or folder a command reads.
INPUT_OPTIONS = (
    ("model", "--model"),
    ("plan", "--plan"),
    ("table", "--table"),
    ("eval", "--eval"),
    ("recovered_eval", "--recovered-eval"),
    ("teacher", "--teacher"),
    ("include_path", "--include-path"),
    ("checkpoint", "the checkpoint"),
)


def command_inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, path) of every file or folder the command reads: what no output may be.

    The cache counts as an input of every command: commands read their tables, converted
    models and run history there, and an output written into it would replace or hide an entry.
    """
    inputs = []
    for dest, flag in INPUT_OPTIONS:
        value = getattr(args, dest, None)
        if value:
            inputs.append((flag, str(value)))
            if value in BUILTIN_NAMES:  # its converted copy in the cache is read
                inputs.append((flag, str(_cache_path() / "models" / value)))
    for dest, flag in (("data", "--data"), ("eval_data", "--eval-data")):
        for part in str(getattr(args, dest, None) or "").split(","):
            if args.command == "recover" and "@" in part:
                part = part.rsplit("@", 1)[0]  # recover's SOURCE@PART names the file before the '@'
            if part.strip().lower().endswith((".txt", ".jsonl")):
                inputs.append((flag, part.strip()))
    inputs.append((CACHE_INPUT, str(_cache_path())))
    return inputs


def check_out(args: argparse.Namespace) -> None:
    """OutputError unless --out can be written as what the command writes there, and is no input
    (nor lies inside the cache); the same for --offload-dir, where --device-map writes weights."""
    inputs = command_inputs(args)
    if getattr(args, "offload_dir", None):
        check_not_an_input(args.offload_dir, inputs, False, "--offload-dir", containers=FOLDER_INPUTS)
    out = getattr(args, "out", None)
    if out is None:
        return
    folder = args.command in FOLDER_OUTPUTS or (args.command == "export" and getattr(args, "format", None) == "hf")
    check_not_an_input(out, inputs, folder, containers=FOLDER_INPUTS)
    if args.command == "recover":
        work = Path(str(out) + PARTIAL_SUFFIX)
        check_not_an_input(work, inputs, True, "--out's work folder", containers=FOLDER_INPUTS)
        if work.is_symlink() or (work.exists() and not work.is_dir()):
            raise OutputError(
                f"--out's work folder {work} is {'a symbolic link' if work.is_symlink() else 'not a folder'}; "
                "gap writes its run state only into a folder of its own: remove it or choose another --out"
            )
    path = check_output(out, folder=folder)
    if folder and path.is_dir() and any(path.iterdir()) and not (path / CHECKPOINT_MARKER).is_file():
        raise OutputError(f"--out {path} is a folder that is neither empty nor a gap checkpoint; refusing to replace it")


def check_cache(args: argparse.Namespace) -> None:
    """CacheError now, not after a text source was read, when the command needs a cache root it
    cannot have: one that is a file, cannot be created, or (for a command that writes there) that
    refuses new files. A read-only cache is refused, not worked around: converting a built-in
    model again on every run, or a table or run that silently goes unrecorded, would be worse."""
    uses_cache = (
        args.command in CACHE_COMMANDS
        or getattr(args, "model", None) in BUILTIN_NAMES
        or getattr(args, "run", None) is not None  # `gap report --run`: the run history
        or bool(getattr(args, "tasks", None))  # --tasks: the offline task's files and the dense model's scores
    )
    inputs = [(flag, path) for flag, path in command_inputs(args) if flag != CACHE_INPUT]
    # Before the root is created: a cache inside a model folder would be written into that input.
    check_not_an_input(_cache_path(), inputs, False, f"the cache ({CACHE_ENV})", containers=FOLDER_INPUTS)
    if not uses_cache:
        return
    root = cache_root()
    if args.command in CACHE_READERS:
        return
    refusal = write_refusal(root)
    if refusal:
        where = "GAP_CACHE_DIR" if os.environ.get("GAP_CACHE_DIR") else "the default cache"
        raise CacheError(
            f"the cache root {root} ({where}) cannot be written: {refusal}; gap keeps converted models, tables, task "
            "files, dense scores and the run history there: make it writable or point GAP_CACHE_DIR at a folder you can write"
        )


def check_paths(args: argparse.Namespace) -> None:
    """Every path the command names through one normaliser (``fsutil.user_path``), in place:
    ``~`` expanded, and a path no file system call could take (bytes that are not UTF-8, an
    unknown ``~user``, a loop of symbolic links, a name too long) refused in one line."""
    for dest, flag in (*INPUT_OPTIONS, ("out", "--out"), ("offload_dir", "--offload-dir")):
        value = getattr(args, dest, None)
        if value is not None:
            normal_path = user_path(value, flag, DataError)
            setattr(args, dest, Path(normal_path) if isinstance(value, Path) else normal_path)
    for dest, flag in (("data", "--data"), ("eval_data", "--eval-data")):
        value = getattr(args, dest, None)
        if value:
            parts = str(value).split(",")
            normal = [_normal_source(part, flag, args.command == "recover") for part in parts]
            if normal != parts:  # only a path that was expanded changes the text (it is part of a table's key)
                setattr(args, dest, ",".join(normal))
    if args.command == "recover" and getattr(args, "out", None):
        user_path(str(args.out) + PARTIAL_SUFFIX, "--out's work folder", DataError)  # OUT.partial must fit NAME_MAX too


def _normal_source(part: str, flag: str, recover: bool) -> str:
    """A text source of --data: a .txt/.jsonl path normalised (recover's SOURCE@PART keeps its part)."""
    path, at, where = part.rpartition("@") if recover and "@" in part else (part, "", "")
    if not path.strip().lower().endswith((".txt", ".jsonl")):
        return part
    normal = user_path(path.strip(), flag, DataError)
    return part if normal == path.strip() else normal + at + where


def preflight(args: argparse.Namespace) -> None:
    """Every check above, in the order a user fixes them: paths, options, sizes, names, sources, output, cache."""
    check_paths(args)
    check_option_rules(args)
    check_sizes(args)
    check_sources(args)
    check_models(args)
    check_source_specs(args)
    check_max_memory(args)
    check_out(args)
    check_cache(args)
