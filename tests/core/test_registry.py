"""Registries of choices (core.registry): one declaration per criterion, estimator, objective,
allocator and recovery method, on the function that does it, read by the CLI, the validators and
the planner; a name declared twice is refused; adding an allocator is one new file."""

from __future__ import annotations

import argparse
import ast
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
from gap_engine.core.registry import Choice, Registry, RegistryError
from gap_engine.plan import allocator_registry, allocators
from gap_engine.plan.allocator_registry import ALLOCATORS
from gap_engine.prune.compensations import COMPENSATIONS
from gap_engine.prune.criteria import CRITERIA, SCORING_CRITERIA
from gap_engine.recover.methods import RECOVERY_METHODS, RECOVERY_OBJECTIVES
from gap_engine.tables.artefact import TableSpec
from gap_engine.tables.estimators import ESTIMATORS
from gap_engine.tables.objectives import OBJECTIVES

REGISTRIES = (COMPENSATIONS, CRITERIA, ESTIMATORS, OBJECTIVES, ALLOCATORS, RECOVERY_METHODS, RECOVERY_OBJECTIVES)
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


NEW_ALLOCATOR = """
\"\"\"A test allocator: the uniform rungs, counted.\"\"\"

from gap_engine.core.registry import register
from gap_engine.plan.baselines import uniform_rungs

CALLS = []


@register("allocator", "counted", "uniform rungs, counting its calls")
def rungs(inputs):
    CALLS.append(inputs.target)
    return uniform_rungs(inputs)
"""


def _package(tmp_path, name: str, files: dict[str, str]) -> str:
    """A package on the import path holding ``files`` (its modules' sources); returns its name."""
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module, source in files.items():
        (package / f"{module}.py").write_text(textwrap.dedent(source))
    return name


def test_an_allocator_is_one_new_file(tmp_path, monkeypatch, make_tiny):
    """Copied beside the others in a plan package, the new file is found from its source alone
    (nothing imported) and planned with like any baseline."""
    shutil.copytree(PLAN_DIR, tmp_path / "plan_copy", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "plan_copy" / "counted.py").write_text(textwrap.dedent(NEW_ALLOCATOR))
    monkeypatch.syspath_prepend(str(tmp_path))
    extended = Registry("allocator", ("plan_copy",), PlanError, first=ALLOCATORS.names)
    assert extended.names == (*ALLOCATORS.names, "counted")
    assert extended["counted"].function == "plan_copy.counted:rungs" and "plan_copy.counted" not in sys.modules
    assert extended["flap"].tags == ALLOCATORS["flap"].tags
    monkeypatch.setattr(allocators, "ALLOCATORS", extended)
    monkeypatch.setattr(allocator_registry, "ALLOCATORS", extended)
    lm = make_tiny("llama")
    plan = allocators.plan_from_table(lm, synthetic_table(lm), 0.3, "counted")
    from plan_copy.counted import CALLS

    assert plan.allocator == "counted" and len(CALLS) == 1
    assert 0 <= plan.params["removed"] - 0.3 * plan.params["dense_prunable"] < mlp_unit(lm)


def test_a_name_declared_twice_is_refused_naming_both(tmp_path, monkeypatch):
    """A second "flap" allocator used to win in silence; now the registry names both declarations."""
    twice = '@register("allocator", "flap", "another FLAP")\ndef flap_again(inputs):\n    return None\n'
    name = _package(
        tmp_path, "twice", {"a": "from gap_engine.core.registry import register\n\n\n" + twice.replace("flap_again", "flap_one")}
    )
    (tmp_path / name / "b.py").write_text("from gap_engine.core.registry import register\n\n\n" + twice)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RegistryError, match=r"allocator 'flap' is declared twice: by twice.a:flap_one and by twice.b:flap_again"):
        Registry("allocator", (name,))


def test_a_declaration_must_be_literal_and_in_the_one_style(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _package(
        tmp_path,
        "computed",
        {"m": 'from gap_engine.core.registry import register\nNAME = "x"\n\n\n@register("allocator", NAME, "y")\ndef f(): ...\n'},
    )
    with pytest.raises(RegistryError, match=r"computed.m.f: @register takes a literal"):
        Registry("allocator", ("computed",))
    _package(tmp_path, "retired", {"m": "DECLARED_ALLOCATORS = (Choice('x', 'y', ':f'),)\n"})  # how allocators were declared before
    with pytest.raises(RegistryError, match="declares its choices in a DECLARED_\\* tuple"):
        Registry("allocator", ("retired",))
    with pytest.raises(RegistryError, match="lists nowhere first, but nothing declares them"):
        Registry("allocator", ("gap_engine.plan",), first=("nowhere",))
    assert Choice("x", "y", "gap_engine.core.registry:Registry").load() is Registry


@pytest.mark.slow
def test_every_declaration_is_in_its_registry():
    """A ``@register`` in a module no registry reads would be dropped in silence."""
    declared = set()
    for path in Path(allocator_registry.__file__).parents[1].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "register" and len(node.args) >= 2:
                declared.add((node.args[0].value, node.args[1].value))
    registered = {(registry.kind, name) for registry in REGISTRIES for name in registry}
    assert declared == registered
