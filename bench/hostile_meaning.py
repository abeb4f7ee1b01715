"""The ``i34`` families of ``bench_hostile.py`` that feed gap inputs to be read for meaning (saved
files, numbers, inputs, links), kept apart from the other families so additions merge cleanly. ``cases(bench)`` is called with the running bench
module (its ``Case``, helpers and ``FIXTURES``, read when a case is prepared); ``build_fixtures``
runs once in a child before the cases; ``open_link`` runs in a case's child for ``LINK`` cases.

- **i34 files**: files read for meaning: a cache entry's spec, a resume state (another model's
  tensors, a learning rate of 1e308), a model with a NaN weight.
- **i34 numbers**: numbers that lie: tables no build makes (``gap front``), plans whose numbers
  contradict their rates (``gap report``), kept indices and plan.json that disagree with the
  config (``gap export --format hf``), a NaN perplexity.
- **i34 inputs**: inputs silently dropped or misread: a teacher that cannot load, a device named
  twice, a tampered resume state, a forged cache entry (an "ok" case whose output is checked).
- **i34 links**: crafted explorer links, opened with AppTest in the case's child.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
bench = None  # the running bench_hostile module, set by cases(): its Case, helpers and FIXTURES

LINK = "__link__"  # argv[0] of a case that opens the explorer at a query string instead of running gap
RESUME = [
    "recover", "--model", "{fx}/ck", "--method", "mezo", "--steps", "4", "--lr", "0.001", "--save-every", "2",
    "--data", "news-sample", "--seq-len", "16", "--batch-size", "1", "--pool-windows", "2", "--no-eval-before",
    "--no-dense", "--no-history", "--eval-samples", "1", "--eval-seq-len", "16", "--generations", "0",
]  # fmt: skip
TABLE34 = ["table", "--estimator", "fisher", "--data", "news-sample", "--samples", "2", "--seq-len", "16", "--rates", "0,0.5"]


def build_fixtures(base: Path) -> None:
    """Resume states saved by real runs (MeZO on ck and on dp, stopped after step 2), a cache holding
    the tables of tiny-llama and ck, a model with one NaN weight and one whose norm epsilon is -1.0."""
    import math

    from safetensors.torch import load_file, save_file

    from gap_engine.cli import main
    from gap_engine.core.progress import Hooks
    from gap_engine.model.loading import load_model
    from gap_engine.pipeline.recovery import RecoverySettings, recover

    def stop_after_2(done, total, eta):
        if eta is not None and done == 3:
            raise RuntimeError("stopped for the fixture")

    settings = RecoverySettings(
        method="mezo", tasks=("news-sample",), steps=4, lr=1e-3, save_every=2, seq_len=16, batch_size=1, pool_windows=2,
        evaluate_before=False, compare_dense=False, record_history=False, eval_samples=1, eval_seq_len=16, eval_generations=0,
    ).validate()  # fmt: skip
    for name in ("ck", "dp"):
        try:
            recover(load_model(str(base / name)), settings, Hooks(progress=stop_after_2), out_dir=base / f"resume-{name}")
        except RuntimeError:
            pass
    os.environ["GAP_CACHE_DIR"] = str(base / "cache34")
    for name in ("tiny-llama", "ck"):
        main([*TABLE34, "--model", str(base / name), "--out", str(base / f"table34-{name}.json")])
    for name, change in (("nan-llama", "weight"), ("eps-llama", "config")):
        shutil.copytree(base / "tiny-llama", base / name)
        if change == "weight":
            tensors = load_file(str(base / name / "model.safetensors"))
            tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = math.nan
            save_file(tensors, str(base / name / "model.safetensors"), metadata={"format": "pt"})
        else:
            config = json.loads((base / name / "config.json").read_text())
            (base / name / "config.json").write_text(json.dumps(config | {"rms_norm_eps": -1.0}))


def open_link(args: list[str]) -> int:
    """Open the explorer at ``k=v`` query items (after an optional page): 0 when it opens with no
    exception, every task picker the link names complete and at most a one-line message about the
    link; 70 (an internal error) when the page raised."""
    from streamlit.testing.v1 import AppTest

    page = args[0] if args and args[0].endswith(".py") else None
    query = dict(item.split("=", 1) for item in args[1 if page else 0 :])
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.query_params.update(query)
    at.run()
    if page and not at.exception:
        at.switch_page(page).run()
    if at.exception:
        print(f"gap: internal error: the page raised {str(at.exception[0].value)[:200]}", file=sys.stderr)
        return 70
    for prefix in {name.split("_")[0] + "_" for name in query if "task" in name}:
        missing = [
            f"{prefix}{key}" for key in ("tasks_on", "tasks", "task_limit", "task_folder") if f"{prefix}{key}" not in at.session_state
        ]
        if missing:
            print(f"gap: internal error: the link left the task picker without {missing[0]}", file=sys.stderr)
            return 70
    message = at.session_state["app_messages"].get("link")
    print(f"opened; {message[1] if message else 'no message about the link'}", file=sys.stderr)  # the report's last line
    return 1 if message is not None and len(str(message[1]).splitlines()) > 1 else 0


def _tampered_table(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        data = json.loads(bench._table_text("extras", {}))
        change(data)
        (d / "t.json").write_text(json.dumps(data))

    return prepare


def _three_rates(d: dict) -> None:
    d["rate_grid"] = d["spec"]["rate_grid"] = [0.0, 0.25, 0.5]
    d.update(removed=[[0, 4_000, 2_000]] * 4, delta=[[0.0, 0.1, 0.2]] * 4, smoothed=[[0.0, 0.1, 0.2]] * 4)
    d.update(cell_objective=[[3.5, 3.6, 3.7]] * 4, measured=[[True, False, False]] * 4)


def _plan34(**changes) -> Callable[[Path], None]:
    """A plan for the tiny model (rates 0.5, on the table's grid) with ``changes``, beside the valid table."""

    def prepare(d: Path) -> None:
        (d / "t.json").write_text(bench._table_text("extras", {}))
        plan = bench.plan_dict() | {"model": str(bench.FIXTURES / "tiny-llama"), "attention_rates": [0.5, 0.5], "mlp_rates": [0.5, 0.5]}
        (d / "p.json").write_text(json.dumps(plan | changes))

    return prepare


def _outside(d: Path, suffix: str) -> Path:
    """A sibling of the case folder: what a case legitimately changes (a cache entry it rebuilds, a
    resume state it consumes) lives there, so the input snapshot of the case folder stays exact."""
    return d.with_name(d.name + suffix)


def _cache_entry(spec_change: dict) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        shutil.copytree(bench.FIXTURES / "cache34", d / "cache", ignore=shutil.ignore_patterns("models"))
        for meta in (d / "cache" / "tables").glob("*/meta.json"):
            data = json.loads(meta.read_text())
            meta.write_text(json.dumps(data | {"spec": data["spec"] | spec_change}))

    return prepare


def _forged_cache(d: Path) -> None:
    """The tiny model's cache entry holding ck's table, its key and checksum made to match (in
    ``{d}-cache``: the entry is rebuilt, which the case folder's snapshot would count as destroyed)."""
    cache = _outside(d, "-cache")
    shutil.copytree(bench.FIXTURES / "cache34", cache, ignore=shutil.ignore_patterns("models"))
    entries = [p for p in (cache / "tables").iterdir() if p.is_dir()]
    victim = next(p for p in entries if "tiny-llama" in p.name)
    other = next(p for p in entries if "tiny-llama" not in p.name)
    table = json.loads((other / "table.json").read_text()) | {"key": victim.name}
    text = json.dumps(table, separators=(",", ":")) + "\n"
    (victim / "table.json").write_text(text)
    meta = json.loads((victim / "meta.json").read_text())
    (victim / "meta.json").write_text(json.dumps(meta | {"table_sha256": hashlib.sha256(text.encode()).hexdigest()}))


def _served_this_models_table(d: Path) -> str | None:
    served = json.loads((d / "t.json").read_text())["model_fingerprint"]
    mine = (bench.FIXTURES / "tiny-llama.fingerprint").read_text()
    return None if served == mine else f"served the table of weights {served}, not the model's {mine}"


def _resume_state(
    edit: Callable[[dict], None] | None = None, tensors_of: str | None = None, outside: bool = False
) -> Callable[[Path], None]:
    """The saved state of a stopped run as ``{d}/rec.partial`` (``{d}-rec.partial`` when the run may
    consume it: a valid resume removes its work folder), changed by ``edit`` or given dp's tensors."""

    def prepare(d: Path) -> None:
        partial = _outside(d, "-rec.partial") if outside else d / "rec.partial"
        shutil.copytree(bench.FIXTURES / "resume-ck.partial", partial)
        state = partial / "state"
        if edit is not None:
            data = json.loads((state / "state.json").read_text())
            edit(data)
            (state / "state.json").write_text(json.dumps(data))  # a NaN goes in bare, as a tamperer writes it
        if tensors_of is not None:
            shutil.copy(bench.FIXTURES / f"resume-{tensors_of}.partial" / "state" / "tensors.safetensors", state / "tensors.safetensors")

    return prepare


def _kept34(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    return bench.both(bench.copy_fixture("dp"), bench.edit_json(f"dp/{name}", change))


def cases(module) -> list:
    global bench
    bench = module
    Case = bench.Case
    front = ["front", "--table", "{d}/t.json", "--out", "{d}/out.csv"]
    report = ["report", "--table", "{d}/t.json", "--plan", "{d}/p.json", "--out", "{d}/r.html"]
    export_hf = ["export", "{d}/dp", "--format", "hf", "--out", "{d}/hf"]
    quiet_eval = ["--samples", "2", "--seq-len", "16", "--no-throughput", "--no-dense", "--generations", "0", "--data", "news-sample"]
    recover1 = [*RESUME[:6], "1", *RESUME[7:], "--out", "{d}/rec"]
    cases = [
        # item 3, saved files
        Case("cache ls: meta.json spec rate_grid 5", "i34 files", ["cache", "ls"], _cache_entry({"rate_grid": 5}), expect="ok", env={"GAP_CACHE_DIR": "{d}/cache"}),
        Case("cache ls: meta.json spec rate_grid null", "i34 files", ["cache", "ls"], _cache_entry({"rate_grid": None}), expect="ok", env={"GAP_CACHE_DIR": "{d}/cache"}),
        Case("resume: another model's tensors", "i34 files", [*RESUME, "--resume", "--out", "{d}/rec"], _resume_state(tensors_of="dp")),
        Case("resume: saved lr 1e308", "i34 files", [*RESUME, "--resume", "--out", "{d}/rec"], _resume_state(lambda s: s.update(lr=1e308))),
        Case("table on a model with a NaN weight", "i34 files", [*TABLE34, "--model", "{fx}/nan-llama", "--no-cache", "--out", "{d}/t.json"]),
        Case("resume control (valid)", "i34 files", [*RESUME, "--resume", "--out", "{d}-rec"], _resume_state(outside=True), expect="ok"),
        # item 4, numbers that lie
        Case("front: a cell removes parameters at rate 0", "i34 numbers", front, _tampered_table(lambda t: t["removed"].__setitem__(0, [100, 6_144]))),
        Case("front: removals shrink as the rate grows", "i34 numbers", front, _tampered_table(_three_rates)),
        Case("front: cells remove everything", "i34 numbers", front, _tampered_table(lambda t: t.update(removed=[[0, 61_440]] * 4))),
        Case("front: delta -1e300", "i34 numbers", front, _tampered_table(lambda t: t.update(delta=[[0.0, -1e300]] * 4, smoothed=None))),
        Case("front: a predicted loss of -1e300", "i34 numbers", front, _tampered_table(lambda t: t.update(cell_objective=[[3.5, -1e300]] * 4, delta=[[0.0, -1e300 - 3.5]] * 4, smoothed=None))),
        Case("front: smoothed is not the smoothing", "i34 numbers", front, _tampered_table(lambda t: t["smoothed"].__setitem__(0, [0.0, 5.0]))),
        Case("report: plan budget 1% removed 0 for rates 0.5", "i34 numbers", report, _plan34(budget=0.01, params={"removed": 0})),
        Case("report: plan removes 1e300", "i34 numbers", report, _plan34(params={"removed": 1e300})),
        Case("report: plan removes -20000 (-50%)", "i34 numbers", report, _plan34(params={"removed": -20_000})),
        Case("report: plan predicts -5", "i34 numbers", report, _plan34(predicted_loss=-5.0)),
        Case("report: plan control (valid)", "i34 numbers", report, _plan34(), expect="ok"),
        Case("export hf: kept head 99 of 4", "i34 numbers", export_hf, _kept34("kept_indices.json", lambda k: k["kept_heads"][0].__setitem__(0, 99))),
        Case("export hf: 10 channels where 48 are kept", "i34 numbers", export_hf, _kept34("kept_indices.json", lambda k: k["kept_channels"].__setitem__(0, list(range(10))))),
        Case("export hf: 3 blocks for 2 layers", "i34 numbers", export_hf, _kept34("kept_indices.json", lambda k: [k[x].append(k[x][0]) for x in ("kept_heads", "kept_kv_heads", "kept_channels")])),
        Case("export hf: plan.json for 3 layers", "i34 numbers", export_hf, _kept34("plan.json", lambda p: p.update(num_layers=3, attention_rates=[0.5, 0.0, 0.0], mlp_rates=[0.5, 0.25, 0.0]))),
        Case("eval: one NaN weight", "i34 numbers", ["eval", "--model", "{fx}/nan-llama", *quiet_eval]),
        Case("eval: rms_norm_eps -1.0", "i34 numbers", ["eval", "--model", "{fx}/eps-llama", *quiet_eval]),
        # item 5, inputs silently dropped or misread
        Case("recover --teacher nobody/none offline", "i34 inputs", [*recover1, "--teacher", "nobody/none"], env={"HF_HUB_OFFLINE": "1"}),
        Case("recover --teacher /dev/zero", "i34 inputs", [*recover1, "--teacher", "/dev/zero"]),
        Case("recover --teacher with a NaN weight", "i34 inputs", [*recover1, "--teacher", "{fx}/nan-llama"]),
        Case("recover --teacher beside --objective lm", "i34 inputs", [*recover1, "--teacher", "{fx}/tiny-llama", "--objective", "lm"]),
        Case("eval --max-memory cpu=1GB,cpu=2GB", "i34 inputs", ["eval", "--model", "{fx}/ck", "--device-map", "auto", "--max-memory", "cpu=1GB,cpu=2GB"]),
        Case("eval --max-memory cuda:²=1GB", "i34 inputs", ["eval", "--model", "{fx}/ck", "--device-map", "auto", "--max-memory", "cuda:²=1GB"]),
        Case("resume: saved lr -1", "i34 inputs", [*RESUME, "--resume", "--out", "{d}/rec"], _resume_state(lambda s: s.update(lr=-1.0))),
        Case("resume: NaN in the loss curve", "i34 inputs", [*RESUME, "--resume", "--out", "{d}/rec"], _resume_state(lambda s: s["curve"][0].update(loss=float("nan")))),
        Case("table: a forged cache entry (another model's table)", "i34 inputs", [*TABLE34, "--model", "{fx}/tiny-llama", "--out", "{d}/t.json"], _forged_cache, expect="ok", env={"GAP_CACHE_DIR": "{d}-cache"}, verify=_served_this_models_table),
    ]  # fmt: skip
    links = {
        "run=²": [], "runs=1,²": [], "eval_task_limit=²": [], "recovery=²": [],
        "eval_tasks=gap_wiki_next": ["explorer/evaluate.py"], "recover_tasks=off": ["explorer/recover.py"],
        "table=../../etc": [], "budget=nan": ["explorer/planner.py"],
    }  # fmt: skip
    for query, page in links.items():
        cases.append(
            Case(
                f"link ?{query}" + (f" on {page[0]}" if page else ""),
                "i34 links",
                [LINK, *page, query],
                expect="ok",
                env={"GAP_CACHE_DIR": "{d}/cache"},
            )
        )
    return cases
