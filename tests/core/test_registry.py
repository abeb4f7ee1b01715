"""Registries of choices (core.registry): one explicit table per kind, each entry naming its code
as ``"module:attribute"`` and carrying its properties, read by the CLI, the validators, the cost
model and the figures; a name given twice is refused; a plugin module adds a strategy in one file."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from synthetic_tables import synthetic_table

from gap_engine import api
from gap_engine.cli.main import main
from gap_engine.cli.parser import build_parser
from gap_engine.core.config import WindowSpec
from gap_engine.core.errors import PlanError, TableError
from gap_engine.core.progress import PLAN
from gap_engine.core.registry import PLUGINS_VARIABLE, Registry, RegistryError, Strategy
from gap_engine.data.sources import gensim_test_file
from gap_engine.pipeline.cost_model import baselines_prediction, plan_seconds
from gap_engine.plan.allocator_registry import ALLOCATORS, Allocator
from gap_engine.prune.compensations import COMPENSATIONS
from gap_engine.prune.criteria import CRITERIA, SCORING_CRITERIA
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.objectives import OBJECTIVES
from gap_engine.views.figures import allocator_style

REGISTRIES = (COMPENSATIONS, CRITERIA, ESTIMATORS, OBJECTIVES, ALLOCATORS, RECOVERY_METHODS, RECOVERY_OBJECTIVES)
ENGINE = Path(__file__).resolve().parents[2] / "gap_engine"
TARGET = re.compile(r"(gap_engine(?:\.\w+)+):(\w+)")  # how an entry names its code


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_every_choice_has_one_line_and_a_function(registry):
    assert len(registry) >= 2
    for name in registry:
        choice = registry[name]
        assert isinstance(choice, registry.entry) and choice.name == name
        assert choice.description and "\n" not in choice.description
        assert callable(choice.load()), choice.function
        assert registry.label(name) == f"{name} — {choice.description}"


@pytest.mark.slow
def test_every_module_attribute_string_in_the_engine_resolves_to_a_callable():
    """The tables are the registered functions' callers a grep finds: each string names a real,
    callable attribute, and every table's entries are among those strings."""
    named = set()
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET.fullmatch(node.value):
                named.add(node.value)
    for target in sorted(named):
        assert callable(Strategy("x", "y", target).load()), target
    assert {registry[name].function for registry in REGISTRIES for name in registry} <= named


def test_an_entry_naming_no_function_is_one_line():
    with pytest.raises(
        RegistryError, match=r"^'x' names gap_engine.core.registry:PLUGINS_VARIABLE, which is not a function of gap_engine.core.registry$"
    ):
        Strategy("x", "y", "gap_engine.core.registry:PLUGINS_VARIABLE").load()


def test_the_cli_offers_exactly_the_registered_choices():
    offered = _offered(build_parser())
    assert offered["table", "criterion"] == SCORING_CRITERIA.names
    assert offered["prune", "criterion"] == CRITERIA.names
    assert offered["table", "estimator"] == ESTIMATORS.names
    assert offered["table", "objective"] == OBJECTIVES.names
    assert offered["plan", "allocator"] == ALLOCATORS.names
    assert offered["plan", "compensate"] == COMPENSATIONS.names
    assert offered["recover", "method"] == RECOVERY_METHODS.names
    assert offered["recover", "objective"] == RECOVERY_OBJECTIVES.names


def _offered(parser: argparse.ArgumentParser) -> dict[tuple[str, str], tuple]:
    offered: dict[tuple[str, str], tuple] = {}
    for command, sub in next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices.items():
        for action in sub._actions:
            if action.choices and action.help != argparse.SUPPRESS:
                offered[command, action.dest] = tuple(action.choices)
    return offered


def test_validators_name_the_registered_choices():
    with pytest.raises(TableError, match="unknown table estimator 'guess'; choose one of fisher, taylor, refine, exact"):
        TableSpec(estimator="guess").validate()
    with pytest.raises(TableError, match="unknown criterion 'psychic'"):
        TableSpec(criterion="psychic").validate()
    with pytest.raises(PlanError, match="unknown allocator 'random'; choose one of dp, uniform, flap, owl, evo, slimgpt"):
        ALLOCATORS.check("random")
    with pytest.raises(PlanError, match="unknown criterion 'psychic'; choose one of magnitude, wanda, flap, taylor, obs"):
        CRITERIA.check("psychic")


def test_the_parser_and_the_registries_load_no_torch():
    code = "import sys, gap_engine.cli.parser as p; p.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_name_given_twice_is_refused_naming_both():
    one, other = (
        Allocator("flap", "FLAP", f"gap_engine.plan.baselines:{f}", plan_passes=1.0) for f in ("flap_ladder_steps", "owl_ladder_steps")
    )
    with pytest.raises(
        RegistryError, match=r"allocator 'flap' is given twice: by gap_engine.plan.baselines:flap_ladder_steps and by .*:owl_ladder_steps"
    ):
        Registry("allocator", Allocator, (one, other))


def test_an_allocator_without_a_price_cannot_be_written():
    """The cost model prices every allocator from its entry: an entry without its price is no entry."""
    with pytest.raises(TypeError, match="plan_passes"):
        Allocator("cheap", "no price given", "gap_engine.plan.baselines:uniform_ladder_steps")  # type: ignore[call-arg]


# ---- plugins: a new strategy is one new file -------------------------------------------------------
REVERSE_MAGNITUDE = '''
"""A toy criterion: the smallest weights are kept (magnitude, reversed)."""

from gap_engine.prune.criteria import Criterion
from gap_engine.prune.importance import LayerScores, magnitude_scores

CALLS = []


def reverse_magnitude_scores(lm, windows, batch_size):
    CALLS.append(lm.name)
    return [LayerScores(head=-layer.head, channel=-layer.channel) for layer in magnitude_scores(lm, windows, batch_size)]


STRATEGIES = [Criterion("reverse", "magnitude, reversed", f"{__name__}:reverse_magnitude_scores", score_passes=0.0)]
'''
COUNTED_UNIFORM = '''
"""A toy allocator: uniform ladder steps, counted, pruning by the toy criterion."""

from gap_engine.plan.allocator_registry import Allocator
from gap_engine.plan.baselines import uniform_ladder_steps

CALLS = []


def counted_ladder_steps(inputs):
    CALLS.append(inputs.criterion)
    return uniform_ladder_steps(inputs)


STRATEGIES = [
    Allocator("counted", "uniform ladder steps, counted", f"{__name__}:counted_ladder_steps", plan_passes=3.0, criterion="reverse", color="#123456")
]
'''
HALF_BIAS = '''
"""A toy compensation: half of FLAP's bias."""

import dataclasses

from gap_engine.prune.compensate import bias_fit
from gap_engine.prune.compensations import Compensation

CALLS = []


def half_bias_fit(moments, weight, kept, damping, what):
    CALLS.append(what)
    fit = bias_fit(moments, weight, kept, damping, what)
    return fit if fit.bias is None else dataclasses.replace(fit, bias=fit.bias / 2)


STRATEGIES = [Compensation("halfbias", "half of FLAP's bias", f"{__name__}:half_bias_fit", adds_bias=True)]
'''


def _plugins(tmp_path, monkeypatch, package: str, files: dict[str, str]) -> str:
    """A package of plugin modules on the import path, named in GAP_PLUGINS; returns its name."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    for module, source in files.items():
        (tmp_path / package / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PLUGINS_VARIABLE, ",".join(f"{package}.{module}" for module in files))
    return package


@pytest.mark.slow
def test_a_criterion_an_allocator_and_a_compensation_are_one_new_file_each(tmp_path, monkeypatch, make_tiny):
    """Three new modules, no other file edited: the CLI offers them, the cost model prices them
    from their entries, the figures draw them, and the Python API plans and prunes with them."""
    package = _plugins(
        tmp_path, monkeypatch, "toy_strategies", {"reverse": REVERSE_MAGNITUDE, "counted": COUNTED_UNIFORM, "half": HALF_BIAS}
    )
    offered = _offered(build_parser())
    assert offered["plan", "allocator"][-1] == "counted" and offered["plan", "compensate"][-1] == "halfbias"
    assert offered["table", "criterion"][-1] == offered["prune", "criterion"][-1] == "reverse"

    text = tmp_path / "news.txt"  # real text, a few articles: cheaper to cut than a whole built-in source
    text.write_text("\n".join(gensim_test_file("lee_background.cor").read_text().splitlines()[:12]) + "\n")
    windows = WindowSpec(str(text), n_samples=4, seq_len=32, batch_size=2)
    assert plan_seconds("counted", 2.0, 0.5) == 6.0  # three calibration passes, as its entry says
    counted, owl = (baselines_prediction("smollm2-135m", windows, "wanda", [name], budgets=1) for name in ("counted", "owl"))
    assert counted.seconds[PLAN] == pytest.approx(3 * owl.seconds[PLAN])
    assert allocator_style("counted") == ("circle", "#123456")

    lm = make_tiny("llama")
    plan = api.plan(lm, synthetic_table(lm), 0.3, allocator="counted", compensate="halfbias")
    assert (plan.allocator, plan.criterion, plan.compensation) == ("counted", "reverse", "halfbias")
    assert plan.params["bias_params"] > 0  # the compensation's entry says it adds biases: the budget paid for them
    pruned = api.prune(lm, plan, calibration=windows)
    modules = {name: sys.modules[f"{package}.{name}"] for name in ("reverse", "counted", "half")}
    assert modules["counted"].CALLS == ["reverse"] and modules["reverse"].CALLS == [lm.name] and modules["half"].CALLS
    assert pruned.result.compensation["mode"] == "halfbias"
    assert pruned.params == pruned.plan.params["pruned_total_with_biases"] < lm.param_count()


def test_a_plugin_that_repeats_a_name_or_does_not_import_is_one_line(tmp_path, monkeypatch, capsys):
    _plugins(tmp_path, monkeypatch, "clashing", {"flap_again": COUNTED_UNIFORM.replace('Allocator("counted"', 'Allocator("flap"')})
    with pytest.raises(
        RegistryError, match=r"allocator 'flap' is given twice: by gap_engine.plan.baselines:flap_ladder_steps and by clashing"
    ):
        ALLOCATORS.check("dp")
    monkeypatch.setenv(PLUGINS_VARIABLE, "no_such_plugin_module")
    assert main(["plan", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "gap: error: plugin module 'no_such_plugin_module' (GAP_PLUGINS) does not import: ModuleNotFoundError: No module named 'no_such_plugin_module'"
    )
    monkeypatch.delenv(PLUGINS_VARIABLE)
    assert ALLOCATORS.names == ("dp", "uniform", "flap", "owl", "evo", "slimgpt")
