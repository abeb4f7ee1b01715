"""Registries of choices (core.registry): one declaration per criterion, estimator, objective,
allocator and recovery method, read by the CLI, the validators and the planner; adding an
allocator is one new file."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from synthetic_tables import mlp_unit, synthetic_table

from gap_engine.cli.parser import build_parser
from gap_engine.core import config
from gap_engine.core.errors import PlanError, TableError
from gap_engine.core.registry import Choice, Registry, declared_choices
from gap_engine.plan import allocator_registry, allocators
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.prune.criteria import CRITERIA, SCORING_CRITERIA
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.objectives import OBJECTIVES

REGISTRIES = (CRITERIA, ESTIMATORS, OBJECTIVES, ALLOCATORS, RECOVERY_METHODS, RECOVERY_OBJECTIVES)
PLAN_DIR = Path(allocator_registry.__file__).parent


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_every_choice_has_one_line_and_a_function(registry):
    assert len(registry) >= 2
    for name in registry:
        choice = registry[name]
        assert choice.description and "\n" not in choice.description
        assert callable(choice.load()), choice.function
        assert registry.label(name) == f"{name} — {choice.description}"


def test_the_cli_offers_exactly_the_registered_choices():
    parser = build_parser()
    offered: dict[tuple[str, str], tuple] = {}
    for sub in next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices.items():
        for action in sub[1]._actions:
            if action.choices and action.help != argparse.SUPPRESS:
                offered[sub[0], action.dest] = tuple(action.choices)
    assert offered["table", "criterion"] == SCORING_CRITERIA.names
    assert offered["table", "estimator"] == ESTIMATORS.names
    assert offered["table", "objective"] == OBJECTIVES.names
    assert offered["plan", "allocator"] == ALLOCATORS.names
    assert offered["recover", "method"] == RECOVERY_METHODS.names
    assert offered["recover", "objective"] == RECOVERY_OBJECTIVES.names
    assert CRITERIA.names == config.CRITERIA  # what RatePlan (below prune) validates against


def test_validators_name_the_registered_choices():
    with pytest.raises(TableError, match="unknown table estimator 'guess'; choose one of fisher, taylor, refine, exact"):
        TableSpec(estimator="guess").validate()
    with pytest.raises(TableError, match="unknown criterion 'psychic'"):
        TableSpec(criterion="psychic").validate()
    with pytest.raises(PlanError, match="unknown allocator 'random'; choose one of dp, uniform, flap, owl, evo, slimgpt"):
        ALLOCATORS.check("random")


def test_the_parser_and_the_registries_load_no_torch():
    code = "import sys, gap_engine.cli.parser as p; p.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


NEW_ALLOCATOR = '''
"""A test allocator: the uniform rungs, counted."""

from gap_engine.core.registry import Choice
from gap_engine.plan.baselines import uniform_rungs

CALLS = []
DECLARED_ALLOCATORS = (Choice("counted", "uniform rungs, counting its calls", ":rungs"),)


def rungs(inputs):
    CALLS.append(inputs.target)
    return uniform_rungs(inputs)
'''


def test_an_allocator_is_one_new_file(tmp_path, monkeypatch, make_tiny):
    # Found in plan/ beside the others, from its source alone ...
    copy = tmp_path / "plan"
    shutil.copytree(PLAN_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "counted.py").write_text(textwrap.dedent(NEW_ALLOCATOR))
    found = declared_choices(copy, "gap_engine.plan", "DECLARED_ALLOCATORS", first=ALLOCATORS.names)
    assert [c.name for c in found] == [*ALLOCATORS.names, "counted"]
    assert found[-1].function == "gap_engine.plan.counted:rungs"
    # ... and, once registered, planned with like any baseline (the file importable as a module).
    package = tmp_path / "extra"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "counted.py").write_text(textwrap.dedent(NEW_ALLOCATOR))
    monkeypatch.syspath_prepend(str(tmp_path))
    extended = Registry(
        "allocator", [ALLOCATORS[n] for n in ALLOCATORS] + declared_choices(package, "extra", "DECLARED_ALLOCATORS"), PlanError
    )
    monkeypatch.setattr(allocators, "ALLOCATORS", extended)
    monkeypatch.setattr(allocator_registry, "ALLOCATORS", extended)
    lm = make_tiny("llama")
    plan = allocators.plan_from_table(lm, synthetic_table(lm), 0.3, "counted")
    from extra.counted import CALLS

    assert plan.allocator == "counted" and len(CALLS) == 1
    assert 0 <= plan.params["removed"] - 0.3 * plan.params["dense_prunable"] < mlp_unit(lm)


def test_a_declaration_must_be_literal_choices(tmp_path):
    (tmp_path / "bad.py").write_text("DECLARED_ALLOCATORS = Choice('x', 'y', ':f')\n")
    with pytest.raises(TypeError, match="must be a tuple"):
        declared_choices(tmp_path, "pkg", "DECLARED_ALLOCATORS")
    (tmp_path / "bad.py").write_text("DECLARED_ALLOCATORS = (make('x'),)\n")
    with pytest.raises(TypeError, match="Choice"):
        declared_choices(tmp_path, "pkg", "DECLARED_ALLOCATORS")
    assert Choice("x", "y", "gap_engine.core.registry:Registry").load() is Registry
