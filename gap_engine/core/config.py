"""Settings and named defaults that every surface (CLI, app, benchmarks) reads.

Three choices of the method have three distinct nouns, used the same way in code, flags,
app labels and the README; each kind is registered once, near its stage (``core.registry``):

- the **criterion** decides *which* heads and channels of a layer go (``prune.criteria``);
- the **estimator** decides *how a loss table is filled*: measured cell by cell (``exact``),
  estimated from one gradient pass (``fisher``, ``taylor``), or estimated and then measured
  exactly where the plans go (``refine``) (``tables.estimators``; the cell's objective:
  ``tables.objectives``);
- the **allocator** decides *how much* each layer loses under one global budget: GAP's
  exact DP or a baseline (``plan.allocator_registry``).

Recovery methods are registered in ``recover.methods``.

``WindowSpec`` is the one description of "which token windows a stage reads" shared by
loss tables, importance scores, evaluation and the baselines. This module imports nothing
heavy, so the CLI can build its parser from it before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gap_engine.core.errors import DataError
from gap_engine.core.validate import check_int

# ---- the three choices ------------------------------------------------------------------
# The names each registry holds (prune.criteria, prune.compensations, ...) are listed there only.
DEFAULT_CRITERION = "wanda"
MODES = ("split", "block")  # split: attention and MLP are separate components
DEFAULT_COMPENSATION = "bias"  # FLAP's bias: the best held-out KL and perplexity at 20% and 40% (bench/results/compensation.md)

# ---- budgets and the planner -------------------------------------------------------------
DEFAULT_BUDGET = 0.2  # fraction of prunable parameters removed
DEFAULT_MAX_RATE = 0.95  # no component loses more than this fraction unless locked
DEFAULT_N_BUCKETS = 4096  # budget resolution of the DP (bucket = max removable / this)
DEFAULT_CHANNEL_MULTIPLE = 8  # MLP widths are kept in multiples of this

# ---- devices -----------------------------------------------------------------------------
# accelerate's device-map strategies for evaluating a model spread over several devices
# (``dispatch``): "auto"/"balanced" even out the accelerators, "balanced_low_0" keeps the
# first one light (generation's logits land there), "sequential" fills them in order.
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")

# ---- text --------------------------------------------------------------------------------
DEFAULT_DATA = "wiki-sample"
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class WindowSpec:
    """Which token windows a stage reads: one text source or several, how many windows, how long."""

    data: str = DEFAULT_DATA  # text source: built-in name, .txt/.jsonl path or HF spec; several comma-separated (calibration mixes them)
    n_samples: int = 16  # windows
    seq_len: int = 256  # tokens per window
    seed: int = 0  # which windows are drawn
    batch_size: int = 4  # windows per forward pass (memory only; never changes a number)

    def validate(self) -> WindowSpec:
        """DataError (one line) for a value no stage can use."""
        if not isinstance(self.data, str) or not self.sources():
            raise DataError("the text source must be a non-empty string")
        for name, low in (("n_samples", 1), ("seq_len", 2), ("batch_size", 1)):
            check_int(getattr(self, name), name, DataError, low=low)
        check_int(self.seed, "seed", DataError)
        return self

    def sources(self) -> tuple[str, ...]:
        """The text sources named in ``data`` (one, or several separated by commas)."""
        return tuple(part.strip() for part in str(self.data).split(",") if part.strip())

    def for_source(self, source: str) -> WindowSpec:
        """The same windows read from one other source."""
        return replace(self, data=source)


@dataclass(frozen=True, eq=False)
class StoredWindowSpec(WindowSpec):
    """A WindowSpec read from a file (a loss table's spec): its text sources never reach the
    network. Only what a user typed may be fetched from the Hugging Face hub; a dataset named
    inside a file loads from the local datasets cache or not at all (``data.windows``).

    Equal to the WindowSpec of the same values (a table read back still matches the spec it was
    built for), and ``replace``/``for_source`` keep the class, so the rule travels with it.
    """

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WindowSpec):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in WINDOW_FIELDS)

    __hash__ = WindowSpec.__hash__


WINDOW_FIELDS = ("data", "n_samples", "seq_len", "seed", "batch_size")


# ---- loss tables -------------------------------------------------------------------------
FULL_RATE_GRID = tuple(i / 16 for i in range(16))  # 0, 1/16, ..., 15/16
QUICK_RATE_GRID = tuple(i / 8 for i in range(8))  # 0, 1/8, ..., 7/8
# A refined table measures exactly the cells the DP's plans use at these budgets (fractions
# of the prunable parameters), with their grid neighbours, until every chosen cell is measured.
REFINE_BUDGETS = (0.1, 0.2, 0.3, 0.4)
REFINE_ATTENTION = ("chosen", "all")  # "all": also every attention cell from the start


@dataclass(frozen=True)
class TableDefaults:
    """A starting point for a loss table's settings."""

    estimator: str  # one of tables.estimators.ESTIMATORS
    objective: str  # one of tables.objectives.OBJECTIVES
    windows: WindowSpec  # calibration windows
    rate_grid: tuple[float, ...]  # candidate rates, ascending from 0


# The defaults of every table, from evidence (bench/results/tables.md, bench/results/defaults.md):
# KL to the dense model, because NLL tables are noise (seed-to-seed Spearman 0.15-0.48 against
# 0.83-0.95 for KL); the gradient estimate, because an exact table takes about an hour on two
# CPU cores; and the calibration size whose plans were best on held-out text among the sizes
# that build in about 2-3 minutes there for the default model.
DEFAULT_ESTIMATOR = "fisher"
DEFAULT_OBJECTIVE = "kl"
DEFAULT_TABLE_WINDOWS = WindowSpec(n_samples=16, seq_len=256)
# OBS (SlimGPT's selection and update, the DP's step on Llama) reads its own calibration windows: its
# cost is one Gram matrix per projection, not cells. On the selection part of four held-out sources
# (bench/results/obs_windows.md) 4x the default table's 16 windows beat 16 at 20% and 40%, and 8x
# added nothing; the factor scales with the calibration a user chose, up to the cap.
OBS_WINDOW_FACTOR = 4
OBS_WINDOW_CAP = 128


def obs_window_count(calibration: int, asked: int | None) -> int:
    """How many calibration windows OBS reads: ``asked``, else OBS_WINDOW_FACTOR x the calibration's, at most
    OBS_WINDOW_CAP unless the calibration itself has more (64 for the default table's 16)."""
    return asked if asked is not None else max(calibration, min(OBS_WINDOW_FACTOR * calibration, OBS_WINDOW_CAP))


# What a TableSpec built in code with no settings describes: the measured reference table
# (exact cells of NLL). Surfaces never use it as their default; they use the two below.
REFERENCE_TABLE = TableDefaults(estimator="exact", objective="nll", windows=WindowSpec(), rate_grid=FULL_RATE_GRID)
# `gap table`, `gap compare`, `gap prune --budget` and the benchmarks: a fine grid.
CLI_TABLE = TableDefaults(estimator=DEFAULT_ESTIMATOR, objective=DEFAULT_OBJECTIVE, windows=DEFAULT_TABLE_WINDOWS, rate_grid=FULL_RATE_GRID)
# The explorer: the same table on rates in eighths.
APP_TABLE = TableDefaults(
    estimator=DEFAULT_ESTIMATOR, objective=DEFAULT_OBJECTIVE, windows=DEFAULT_TABLE_WINDOWS, rate_grid=QUICK_RATE_GRID
)

# ---- evaluation --------------------------------------------------------------------------
# Held-out text (never calibration) is divided by document into two parts (``data.windows``):
# every choice (a default, a compensation, "the best of" anything) is made on ``selection``,
# every number reported as a result comes from ``report``. Plain "held-out" means ``report``.
HELDOUT_SPLITS = ("selection", "report")
DEFAULT_HELDOUT_SPLIT = "report"
EVAL_WINDOWS = WindowSpec(n_samples=16, seq_len=256)  # `gap eval`, `gap compare`
APP_EVAL_WINDOWS = WindowSpec(n_samples=8, seq_len=128)  # the explorer's Prune & evaluate


# ---- checkpoints and deployment ----------------------------------------------------------
SAVE_DTYPES = ("bfloat16", "float16", "float32")  # storage precision of a pruned checkpoint
DEFAULT_SAVE_DTYPE = "bfloat16"  # half the bytes of float32, same exponent range (no overflow)
GGUF_OUTTYPES = ("f16", "q8_0")  # weight types of `gap export --format gguf`

# The built-in text sources, shipped in the gensim wheel, by kind (their files, readers and
# descriptions: data.sources.BUILTIN_TEXTS, which checks that it lists these). Named here for the
# layers below data and for the CLI's preflight, which checks names before torch is imported.
# Calibration and held-out text: divided by document into calibration, selection and report parts.
BUILTIN_TEXT_NAMES = ("wiki-sample", "news-sample")
# Held-out text only (selection and report parts): other forms and domains than the calibration
# text, so a quality claim can show that a plan holds on text it never saw. Never calibration text.
HELDOUT_ONLY_TEXT_NAMES = ("newsgroups", "wiki-tables")
# Every built-in source of held-out text: what evaluation and benchmarks can measure on.
HELDOUT_TEXT_NAMES = BUILTIN_TEXT_NAMES + HELDOUT_ONLY_TEXT_NAMES

# ---- recovery after pruning (recover.py) -------------------------------------------------
RECOVERY_SCHEDULES = ("constant", "linear", "cosine")  # learning-rate decay after the warm-up
RECOVERY_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")  # short names of the trainable projections
# Recovery's default training text, from bench/results/recovery_tasks.md: at equal CPU time LoRA-kd
# on both built-in texts raised task accuracy more than on teacher-written text (DP 30%: +3.0 against
# +0.0 points; uniform 30%: +8.2 against +7.6) and left a lower held-out KL to dense.
RECOVERY_DEFAULT_TEXTS = BUILTIN_TEXT_NAMES

# How a rate settles a tie between two attention shapes of one size (``model.units``'s docstring);
# a loss table of a model with ties records it in its cache key.
ATTENTION_TIE_RULE = "more-query-heads"
