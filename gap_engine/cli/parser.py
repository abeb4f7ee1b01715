"""The ``gap`` argument parser: every subcommand, its options and the handler that runs it.

Only ``config`` and the registries of choices (light modules, see ``core.registry``) are
imported here, so ``gap --help`` and a mistyped option answer at once;
a handler (``module:function`` in ``handler``) and the engine it needs are imported only
when the command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

from gap_engine import __version__
from gap_engine.cli.arguments import DeprecatedAlias, add_device_args, add_window_args, rate_arg
from gap_engine.core.config import (
    CLI_TABLE,
    DEFAULT_CHANNEL_MULTIPLE,
    DEFAULT_COMPENSATION,
    DEFAULT_CRITERION,
    DEFAULT_HELDOUT_SPLIT,
    DEFAULT_MAX_RATE,
    DEFAULT_MODEL,
    DEFAULT_N_BUCKETS,
    DEFAULT_SAVE_DTYPE,
    DEVICE_MAPS,
    EVAL_WINDOWS,
    GGUF_OUTTYPES,
    HELDOUT_SPLITS,
    HELDOUT_TEXT_NAMES,
    MODES,
    OBS_WINDOW_CAP,
    OBS_WINDOW_FACTOR,
    RECOVERY_DEFAULT_TEXTS,
    RECOVERY_PROJECTIONS,
    RECOVERY_SCHEDULES,
    REFINE_ATTENTION,
    REFINE_BUDGETS,
    SAVE_DTYPES,
)
from gap_engine.core.deprecation import REMOVED_IN
from gap_engine.core.registry import Registry
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.prune.compensations import COMPENSATIONS, WEIGHTINGS
from gap_engine.prune.criteria import CRITERIA, SCORING_CRITERIA, Criterion
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.objectives import OBJECTIVES


def _grid_text(grid) -> str:
    return ",".join(f"{r:g}" for r in grid)


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the built-in models and supported architectures")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verify", action="store_true", help="also check every converted file against its recorded SHA-256")
    p.set_defaults(handler="model_commands:run_models")


def _add_prune(sub) -> None:
    p = sub.add_parser("prune", help="prune a model with a plan (or a uniform rate, or GAP's DP in rounds) and save a checkpoint")
    p.add_argument("--model", required=True, help="built-in name, local folder, .gguf file or hub id")
    p.add_argument("--plan", help="a plan JSON/YAML file")
    p.add_argument("--uniform", type=rate_arg, help="every layer and component at this rate, in [0, 1)")
    p.add_argument(
        "--budget",
        type=rate_arg,
        help="GAP's DP at this fraction of the prunable parameters, planned in --rounds rounds, each on a loss "
        "table of the model as the rounds before left it",
    )
    p.add_argument("--rounds", type=int, default=1, help="with --budget: rounds of table -> DP -> surgery (default: %(default)s)")
    p.add_argument("--out", required=True, help="output folder (replaced atomically)")
    p.add_argument(
        "--save-dtype",
        default=DEFAULT_SAVE_DTYPE,
        choices=SAVE_DTYPES,
        help="storage precision of the saved weights (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true")
    add_window_args(p, CLI_TABLE.windows)
    # The same table options as `gap table` (one builder, cli.arguments.spec_from_args, reads them for
    # both): with --budget each round builds such a table; --criterion also picks --uniform's units,
    # and replaces a --plan's own. It may name obs, which scores no table: --budget's tables then
    # score units by the default criterion, and obs prunes their DP's rates.
    _add_table_spec_args(p, CLI_TABLE.estimator, criteria=CRITERIA)
    _add_obs_args(p)
    _add_fit_args(p)
    add_device_args(p)
    p.set_defaults(handler="model_commands:run_prune")


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="held-out perplexity, KL to dense, throughput and generations")
    p.add_argument("--model", required=True)
    add_window_args(p, EVAL_WINDOWS, what="held-out (comma-separated sources)", builtins=HELDOUT_TEXT_NAMES)
    p.add_argument("--generations", type=int)
    p.add_argument("--no-dense", action="store_true", help="do not compare with the dense original")
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_device_args(p)
    _add_task_args(p)
    spread = p.add_argument_group("several devices (a model larger than one accelerator)")
    spread.add_argument(
        "--device-map",
        choices=DEVICE_MAPS,
        help="spread whole blocks over this machine's GPUs with accelerate (then host, then --offload-dir); replaces --device and --stream",
    )
    spread.add_argument("--max-memory", help="per-device limits for --device-map, e.g. cuda:0=70GiB,cuda:1=70GiB,cpu=200GiB")
    spread.add_argument("--offload-dir", type=Path, help="where --device-map keeps the weights that fit no device (else that is an error)")
    p.set_defaults(handler="model_commands:run_eval")


def _add_task_args(p: argparse.ArgumentParser) -> None:
    """--tasks and its options: task accuracy through lm-eval (``gap eval``, ``gap compare``)."""
    group = p.add_argument_group("task accuracy (lm-eval)")
    group.add_argument(
        "--tasks",
        help="comma-separated lm-eval tasks: gap_wiki_next (offline, built from wiki-sample), names of the YAMLs "
        "under --include-path, or lm-eval's registered names (their data from the hub or its cache)",
    )
    group.add_argument("--limit", type=int, help="examples per task (default: all)")
    group.add_argument("--num-fewshot", type=int, help="in-context examples (default: the task's own, else 0)")
    group.add_argument("--include-path", help="a folder of lm-eval task YAMLs (dataset_path: json with local data_files)")


def _add_fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fit-samples",
        type=int,
        help="calibration windows the compensation after the cut (bias, refit) is fitted on: the calibration text's source, "
        "length and seed, this many windows, the first of them the table's (default: the table's own, at least 64 on "
        "Gemma 3; the units are still chosen on the table's); a refit solves for every kept input of a projection, so more tokens steady it",
    )
    p.add_argument(
        "--fit-weighting",
        choices=WEIGHTINGS,
        help="how the compensation after the cut (bias, refit, and OBS's bias) counts calibration tokens: tokens, alike, "
        "or output-norm, through the norms after o_proj and down_proj (Gemma 3's post-norms): each token, BOS included, "
        "by the inverse mean square of the projection's dense output on it (default: output-norm on Gemma 3, tokens elsewhere)",
    )


def _add_obs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--obs-samples",
        type=int,
        help="calibration windows the obs criterion chooses units and updates weights on: the calibration text's "
        f"source, length and seed, this many windows (default: {OBS_WINDOW_FACTOR}x --samples or the table's count, at most "
        f"{OBS_WINDOW_CAP}: 64 for the default table; chosen on held-out selection text)",
    )


def _add_table_spec_args(p: argparse.ArgumentParser, estimator_default: str, criteria: Registry[Criterion] = SCORING_CRITERIA) -> None:
    prunes_by = ""
    if criteria is not SCORING_CRITERIA:  # gap prune: a criterion that scores no table (obs) may prune
        prunes_by = (
            " for --uniform and the tables; not given, --budget's DP plan prunes by the model family's step: obs on "
            f"Llama/SmolLM2/Mistral (chosen on held-out text: bench/results/quality.md), {DEFAULT_CRITERION} elsewhere; "
            "given, it replaces a --plan's own criterion; obs, which no table can score, prunes --budget's DP plan, "
            f"its tables scoring units by {DEFAULT_CRITERION}"
        )
    p.add_argument(
        "--criterion",
        choices=criteria.names,
        default=DEFAULT_CRITERION,
        help=f"within-layer importance: which units a rate removes ({criteria.help()}; default: %(default)s{prunes_by})",
    )
    p.add_argument(
        "--rates", default=_grid_text(CLI_TABLE.rate_grid), help="comma-separated rate grid starting at 0 (default: 0, 1/16, ..., 15/16)"
    )
    p.add_argument("--objective", choices=OBJECTIVES.names, default=CLI_TABLE.objective, help=f"{OBJECTIVES.help()} (default: %(default)s)")
    p.add_argument("--mode", choices=MODES, default="split", help="split: attention and MLP apart; block: together")
    p.add_argument(
        "--estimator",
        choices=ESTIMATORS.names,
        default=estimator_default,
        help=f"how the table is filled: {ESTIMATORS.help()} (default: %(default)s)",
    )
    p.add_argument(
        "--refine-budgets",
        default=",".join(f"{b:g}" for b in REFINE_BUDGETS),
        help="refine: budgets whose plans' cells are measured exactly (default: %(default)s)",
    )
    p.add_argument(
        "--refine-attention",
        choices=REFINE_ATTENTION,
        default="chosen",
        help="refine: measure the chosen attention cells only, or every attention cell (default: %(default)s)",
    )
    p.add_argument(
        "--approx",
        dest="estimator",
        choices=ESTIMATORS.subset(lambda estimator: estimator.reads_gradients).names,
        action=DeprecatedAlias,
        new_name="--estimator",
        help=argparse.SUPPRESS,
    )
    p.add_argument("--channel-multiple", type=int, default=DEFAULT_CHANNEL_MULTIPLE, help="MLP width granularity")
    p.add_argument(
        "--compensate",
        choices=COMPENSATIONS.names,
        help=f"what the kept units get after the cut ({COMPENSATIONS.help()}; default: {DEFAULT_COMPENSATION}, bias+refit on Gemma 3, none after obs (the DP's step on Llama) and for --rounds above 1, "
        "and for --plan the plan's own); an exact or refine table measures its cells with it (gap table: only when given); "
        "a budget pays for the biases it adds",
    )


def _add_table(sub) -> None:
    p = sub.add_parser(
        "table",
        help="build (or read from the cache) a loss table",
        description="Measure how much the global objective grows when each layer's attention or MLP "
        "alone is pruned at each rate of a grid (GAP's loss table).",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, model folder, .gguf file or hub id")
    add_window_args(p, CLI_TABLE.windows)
    _add_table_spec_args(p, CLI_TABLE.estimator)
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the table cache")
    p.add_argument("--out", help="where to write the table (.json, or .csv for the long format); not needed with --dry-run")
    add_device_args(p)
    scale = p.add_argument_group("spreading and planning the work")
    scale.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="measure exact cells on Ray workers: a local instance, or the cluster at ADDRESS",
    )
    scale.add_argument(
        "--ray-workers", type=int, default=2, help="Ray worker processes (one per GPU on accelerators; default: %(default)s)"
    )
    scale.add_argument("--dry-run", action="store_true", help="print the predicted time and peak memory of the build and stop")
    scale.add_argument(
        "--profile", help="with --dry-run: price the work on a spec sheet (h200, h100, a100) instead of measuring this machine"
    )
    p.set_defaults(handler="table_commands:run_table")

    cache = sub.add_parser("cache", help="list or remove cached loss tables")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="{ls,rm}")
    cache_sub.required = True
    ls = cache_sub.add_parser("ls", help="list cached loss tables")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a text table")
    ls.set_defaults(handler="table_commands:run_cache_ls")
    rm = cache_sub.add_parser("rm", help="remove one cached loss table")
    rm.add_argument("key", help="a key from `gap cache ls`")
    rm.set_defaults(handler="table_commands:run_cache_rm")


def _add_constraint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lock",
        action="append",
        metavar="LAYERS",
        help="keep layers at a rate: '0,29' (dense) or '0:0.0,5:0.25'; negative counts from the end; repeatable",
    )
    p.add_argument("--min-rate", default="0.0", help="lowest rate of any unlocked component")
    p.add_argument("--max-rate", default=str(DEFAULT_MAX_RATE), help="highest rate of any unlocked component")
    p.add_argument("--coupled", action="store_true", help="a layer's attention and MLP share one rate")


def _add_evo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--evo-generations", type=int, default=4, help="evo: rounds of mutation and selection")
    p.add_argument("--evo-offspring", type=int, default=4, help="evo: candidates per round")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="choose per-layer rates for a budget from a loss table")
    p.add_argument("--table", required=True, help="a loss table JSON file")
    p.add_argument("--budget", help="fraction of prunable parameters to remove, in [0, 1)")
    p.add_argument("--keep-params", type=int, help="instead of --budget: total parameters the pruned model may keep")
    p.add_argument(
        "--allocator",
        default="dp",
        choices=ALLOCATORS.names,
        help=f"how the budget is spread over layers: {ALLOCATORS.help()} (default: %(default)s)",
    )
    # Kept because docs/layout.md promises the old flags work until REMOVED_IN; everywhere else
    # --method is gap recover's recovery method.
    p.add_argument(
        "--method",
        dest="allocator",
        choices=ALLOCATORS.names,
        action=DeprecatedAlias,
        new_name="--allocator",
        help=f"deprecated old name of --allocator, removed in gap-engine {REMOVED_IN} (--method is the recovery method of gap recover)",
    )
    p.add_argument(
        "--compensate",
        choices=COMPENSATIONS.names,
        help=f"the compensation gap prune will apply after the cut (default: {DEFAULT_COMPENSATION}, bias+refit on Gemma 3; none after OBS: slimgpt, and dp on Llama models, whose plans OBS prunes): the biases it "
        "adds are paid from the budget (or --keep-params); recorded in the plan, which gap prune --plan then applies",
    )
    p.add_argument("--model", help="the model (default: the one the table names); its fingerprint must match the table")
    p.add_argument("--out", required=True, help="plan file: .json, or .yaml/.yml")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    _add_constraint_args(p)
    _add_evo_args(p)
    add_device_args(p)
    p.set_defaults(handler="plan_commands:run_plan")

    p = sub.add_parser("front", help="the optimal loss for every budget (CSV), from a loss table alone")
    p.add_argument("--table", required=True, help="a loss table JSON file")
    p.add_argument("--out", required=True, help="CSV file")
    p.add_argument("--n-buckets", type=int, default=DEFAULT_N_BUCKETS, help="budget resolution")
    p.add_argument("--raw", action="store_true", help="plan on the raw deltas, not the smoothed table")
    _add_constraint_args(p)
    p.set_defaults(handler="plan_commands:run_front")


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="prune with several allocators at several budgets and measure them")
    p.add_argument("--model", required=True)
    p.add_argument("--budgets", default="0.1,0.2,0.3", help="comma-separated fractions of prunable parameters")
    p.add_argument(
        "--allocators",
        default="dp,uniform",
        help=f"comma-separated, from {','.join(ALLOCATORS)} ({ALLOCATORS.help()}); ALLOCATOR:CRITERION prunes that allocator's "
        f"plan by another criterion than its own (from {','.join(CRITERIA)}; e.g. dp:obs, DP's rates with SlimGPT's OBS selection and update)",
    )
    p.add_argument("--methods", dest="allocators", action=DeprecatedAlias, new_name="--allocators", help=argparse.SUPPRESS)
    p.add_argument("--table", help="use this loss table instead of building one")
    add_window_args(p, CLI_TABLE.windows)
    _add_table_spec_args(p, CLI_TABLE.estimator)
    p.add_argument(
        "--eval-data",
        default="wiki-sample,news-sample",
        help=f"comma-separated held-out sources: {', '.join(HELDOUT_TEXT_NAMES)}, .txt/.jsonl files or HF specs (default: %(default)s)",
    )
    p.add_argument("--eval-samples", type=int, default=EVAL_WINDOWS.n_samples)
    p.add_argument("--eval-seq-len", type=int, default=EVAL_WINDOWS.seq_len)
    p.add_argument(
        "--split",
        choices=(*HELDOUT_SPLITS, "both"),
        default=DEFAULT_HELDOUT_SPLIT,
        help="which part of the held-out text to measure: report (results; the default), selection (where choices are made) or both",
    )
    p.add_argument("--out", required=True, help="results CSV")
    _add_obs_args(p)
    _add_fit_args(p)
    _add_task_args(p)
    _add_constraint_args(p)
    _add_evo_args(p)
    add_device_args(p)
    p.set_defaults(handler="plan_commands:run_compare")


class OneLineParser(argparse.ArgumentParser):
    """argparse with a usage error as one line on stderr (exit status 2), like every other error.

    Subparsers inherit the class, so ``gap prune --uniform 2`` says what is wrong in one line
    and where to look, instead of a usage block.
    """

    def error(self, message: str):
        message = " ".join("".join(ch if ch.isprintable() else " " for ch in message).split())
        self.exit(2, f"{self.prog}: error: {message[:1000]} (see '{self.prog} --help')\n")


# Subcommands with resource-sized options (checked by cli.preflight against limits.LIMITS).
SIZED_COMMANDS = ("prune", "eval", "table", "plan", "front", "compare")


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML report: table settings, sensitivity, front, plan, evaluation")
    p.add_argument("--table", required=True, help="a loss table JSON file")
    p.add_argument("--plan", help="the chosen plan (JSON or YAML); default: the run's plan, else the DP front row at --budget")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--run", type=int, help="a run id of the history (its plan, numbers and generations)")
    source.add_argument("--eval", help="a `gap eval --json` output file of the pruned model (needs --plan)")
    p.add_argument(
        "--recovered-eval",
        help="a `gap eval --tasks ... --json` output of the recovered checkpoint: its task accuracy becomes the table's recovered row",
    )
    p.add_argument("--budget", help="without a plan or run: report the DP front row at this fraction of prunable parameters (default 0.2)")
    p.add_argument("--out", required=True, type=Path, help="the HTML file to write")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(handler="report_commands:run_report")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as GGUF for llama.cpp, or re-save it in another precision")
    p.add_argument("checkpoint", help="a gap checkpoint folder (for gguf also a built-in name or dense model folder)")
    p.add_argument("--format", choices=("gguf", "hf"), default="gguf", help="gguf: llama.cpp file; hf: transformers folder")
    p.add_argument("--outtype", choices=GGUF_OUTTYPES, default="f16", help="GGUF weight type (default: %(default)s)")
    p.add_argument("--dtype", choices=SAVE_DTYPES, default=DEFAULT_SAVE_DTYPE, help="hf: storage precision (default: %(default)s)")
    p.add_argument("--tokenizer-pre", help="GGUF: llama.cpp pre-tokenizer name when it cannot be detected (e.g. llama-bpe)")
    p.add_argument("--out", required=True, help="output .gguf file or folder (written atomically)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(handler="export_commands:run_export")


def _add_recover(sub) -> None:
    # Tunables default to None: the handler then keeps recover.RecoverySettings' default (one home for them).
    p = sub.add_parser(
        "recover",
        help="recover a pruned model with a short fine-tune (LoRA, MaZO or MeZO)",
        description="Fine-tune a pruned checkpoint on the calibration part of one or more text sources "
        "(each source is one task), evaluate it before and after on their held-out parts, and save it "
        "as a pruned checkpoint that loads like any other.",
    )
    p.add_argument("--model", required=True, help="a `gap prune` folder (a dense model is allowed too)")
    p.add_argument("--method", required=True, choices=RECOVERY_METHODS.names, help=f"the recovery method: {RECOVERY_METHODS.help()}")
    p.add_argument(
        "--data",
        default=",".join(RECOVERY_DEFAULT_TEXTS),
        help="comma-separated text sources, one task each (calibration part only); teacher[:N]: N tokens the dense model writes "
        f"(default: {','.join(RECOVERY_DEFAULT_TEXTS)}, which raised task accuracy most in bench/results/recovery_tasks.md)",
    )
    p.add_argument(
        "--eval-data",
        help=f"held-out texts of the evaluation, e.g. {','.join(HELDOUT_TEXT_NAMES)} "
        "(default: the named --data texts, else wiki-sample,news-sample)",
    )
    p.add_argument("--split", default="calibration", help="the part of the text to train on: only 'calibration' is allowed")
    p.add_argument("--steps", type=int, required=True, help="training steps")
    p.add_argument("--out", required=True, help="output checkpoint folder (written atomically; work goes to OUT.partial)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in OUT.partial")
    p.add_argument(
        "--objective",
        choices=RECOVERY_OBJECTIVES.names,
        help=f"{RECOVERY_OBJECTIVES.help()} (default: kd when the checkpoint's dense base model is reachable, else lm)",
    )
    p.add_argument("--temperature", type=float, help="distillation temperature, in (0, 100] (default 1)")
    p.add_argument("--kd-weight", type=float, help="kd+lm: weight of kd in w*kd + (1-w)*lm (default 0.5)")
    p.add_argument("--teacher", help="the dense model to distil from (default: the checkpoint's base model)")
    p.add_argument("--save-dtype", choices=SAVE_DTYPES, help="storage precision of the recovered checkpoint (default: the input's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: lora 3e-3, mazo 3e-4, mezo 1e-4)")
    p.add_argument("--schedule", choices=RECOVERY_SCHEDULES)
    p.add_argument("--warmup", type=int, help="warm-up steps")
    p.add_argument("--batch-size", type=int, help="windows per task per step")
    p.add_argument("--seq-len", type=int, help="tokens per training window")
    p.add_argument("--pool-windows", type=int, help="calibration windows cut per task")
    p.add_argument("--targets", help="comma-separated projections that train (default: all of " + ",".join(RECOVERY_PROJECTIONS) + ")")
    p.add_argument("--rank", type=int, help="LoRA rank")
    p.add_argument("--alpha", type=float, help="LoRA alpha")
    p.add_argument("--dropout", type=float, help="LoRA dropout")
    p.add_argument("--eps", type=float, help="ZO perturbation scale")
    p.add_argument("--mask-fraction", type=float, help="MaZO: share of each row that trains")
    p.add_argument("--magnitude-weight", type=float, help="MaZO: weight of |W| in the importance")
    p.add_argument("--seed", type=int)
    p.add_argument("--save-every", type=int, help="steps between saved snapshots (and divergence-guard checks)")
    p.add_argument(
        "--no-guard",
        action="store_true",
        help="keep training when the calibration objective rises (default: roll back to the last snapshot and cut the rate)",
    )
    p.add_argument("--time-budget", type=float, help="stop training after this many seconds")
    p.add_argument("--cpu-budget", type=float, help="stop training after this many CPU-seconds of the process")
    p.add_argument("--eval-tasks", help="lm-eval tasks that judge snapshots during training; the best is kept (needs --eval-every)")
    p.add_argument("--eval-every", type=int, help="steps between judged snapshots (a multiple of --save-every); alone: by held-out KL")
    p.add_argument("--eval-task-examples", type=int, help="examples of each --eval-tasks task judged: its last ones (default 100)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the training forward passes")
    p.add_argument("--eval-samples", type=int, help="held-out windows per task")
    p.add_argument("--eval-seq-len", type=int)
    p.add_argument("--generations", type=int)
    p.add_argument("--no-eval-before", action="store_true", help="skip the evaluation before training")
    p.add_argument("--no-dense", action="store_true", help="do not load the dense model for KL and agreement")
    p.add_argument("--no-history", action="store_true", help="do not add the run to the run history")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--force-size",
        action="store_true",
        help="write teacher text past its ceilings (tokens, and the time the cost model predicts here; also: GAP_FORCE_SIZE=1)",
    )
    p.set_defaults(handler="recover_commands:run_recover")
    add_device_args(p)


_NOT_GIVEN = object()  # the default explicit_options gives every option, to tell a given value from a default


def _every_action(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser`` and of all its subcommands (argparse keeps them in ``_actions``)."""
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                actions += _every_action(sub)
    return actions


def explicit_options(argv: list[str] | None) -> frozenset[str]:
    """The destinations of the options ``argv`` gives itself, told apart from those left at their
    defaults (``--samples 64`` is given even where 64 is the default): argv is parsed again by a
    parser whose every default is a marker no value can equal. For the rules on options that
    cannot apply as the command is given (``cli.preflight.check_option_rules``)."""
    parser = build_parser()
    accumulating = set()  # append and count actions add to their default: theirs is None, which only a given value replaces
    for action in _every_action(parser):
        if isinstance(action, (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction)):
            action.default = None
            accumulating.add(action.dest)
        else:
            action.default = _NOT_GIVEN
    with contextlib.redirect_stderr(io.StringIO()):  # a deprecated flag's warning was printed by the first parse
        namespace = parser.parse_args(argv)
    return frozenset(
        dest for dest, value in vars(namespace).items() if value is not _NOT_GIVEN and not (dest in accumulating and value is None)
    )


def build_parser() -> argparse.ArgumentParser:
    """The whole ``gap`` parser; each subcommand sets ``handler`` to "module:function" under gap_engine.cli."""
    parser = OneLineParser(prog="gap", description="Layer-adaptive structured pruning of LLMs (GAP)")
    parser.add_argument("--version", action="version", version=f"gap_engine {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_models, _add_prune, _add_eval, _add_table, _add_plan, _add_compare, _add_report, _add_recover, _add_export):
        add(sub)
    for name in SIZED_COMMANDS:
        sub.choices[name].add_argument(
            "--force-size",
            action="store_true",
            help="accept sizes past the ceilings that protect this machine (also: GAP_FORCE_SIZE=1; see docs/errors-and-limits.md)",
        )
    return parser
