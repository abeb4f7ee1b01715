"""The ``i34`` families of ``bench_hostile.py`` (foreign code, outputs, paths, network and output
hygiene), kept apart from the other families so additions merge cleanly. ``cases(bench)`` is called with the running
bench module (its ``Case``, helpers and ``FIXTURES``, read when a case is prepared).

- **i34 code**: a model folder (or a checkpoint) that names Python of its own in ``auto_map``;
  the planted module writes ``MARKER`` when imported, and the child's stdin stays open and
  silent, so a prompt would wait: verdicts "code executed" and "prompted" catch either.
- **i34 outputs**: every input option and the cache's own files in the out≠in rule.
- **i34 paths**: ``~nosuchuser``, loops of symbolic links, bytes that are not UTF-8, names past
  NAME_MAX, in options and in ``GAP_CACHE_DIR``.
- **i34 network and foreign writes**: a text source named in a table, ``OUT.partial`` linked to a
  foreign folder, a cache inside the model folder, ``prune --out LINK``.
- **i34 output hygiene**: a terminal escape read from disk, stderr on ``/dev/full``, a deleted
  working folder, a 255-byte output name, a million identical documents.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

NOT_UTF8 = os.fsdecode(b"\xff")  # how Python hands over a byte of a name that is not UTF-8
EVAL = ["--samples", "2", "--seq-len", "16", "--no-dense", "--no-throughput", "--generations", "0", "--data", "news-sample"]
RECOVER = ["--method", "mezo", "--steps", "1", "--data", "news-sample", "--seq-len", "16", "--pool-windows", "2", "--no-history"]
TABLE = ["--samples", "2", "--seq-len", "16", "--rates", "0,0.5", "--estimator", "fisher"]
SAME_LINE = "Pruning keeps the attention heads that matter most to the loss.\n"


def cases(bench) -> list:
    return _code(bench) + _outputs(bench) + _paths(bench) + _network_and_foreign(bench) + _hygiene(bench)


# ---- item 1: a folder's code ------------------------------------------------------------------------
def _plant(where: str, folder: str, model_type: str | None = "evil"):
    """Name a module of the folder's own in ``where``'s auto_map; importing it writes {d}/MARKER."""

    def prepare(d: Path) -> None:
        marker = d / "MARKER"
        (d / folder / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
        path = d / folder / where
        data = json.loads(path.read_text())
        if where == "config.json":
            if model_type:
                data["model_type"] = model_type
            data["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
        else:
            data["tokenizer_class"] = "EvilTokenizer"
            data["auto_map"] = {"AutoTokenizer": [None, "modeling_evil.EvilTokenizer"]}
        path.write_text(json.dumps(data))

    return prepare


def _code(bench) -> list:
    Case, both = bench.Case, bench.both
    plain = lambda d: shutil.copytree(bench.FIXTURES / "tiny-llama", d / "evil")  # noqa: E731
    ck = bench.copy_fixture("ck")
    commands = {
        "eval": ["eval", "--model", "{d}/evil", *EVAL],
        "table": ["table", "--model", "{d}/evil", *TABLE, "--out", "{d}/t.json"],
        "table --dry-run": ["table", "--model", "{d}/evil", "--dry-run"],
        "prune": ["prune", "--model", "{d}/evil", "--uniform", "0.25", "--criterion", "magnitude", "--out", "{d}/out"],
        "export gguf": ["export", "{d}/evil", "--out", "{d}/m.gguf"],
        "recover": ["recover", "--model", "{d}/evil", *RECOVER, "--out", "{d}/r"],
        "compare": ["compare", "--model", "{d}/evil", "--budgets", "0.2", *TABLE, "--out", "{d}/c.csv"],
    }
    out = []
    for name, argv in commands.items():
        out.append(
            Case(
                f"folder with its own code ({name})",
                "i34 code",
                argv,
                both(plain, _plant("config.json", "evil")),
                stdin_open=True,
                marker="MARKER",
            )
        )
    variants = {
        "auto_map beside a known model_type (eval)": (commands["eval"], both(plain, _plant("config.json", "evil", None))),
        "tokenizer_config auto_map (eval)": (commands["eval"], both(plain, _plant("tokenizer_config.json", "evil"))),
        "tokenizer_config auto_map (table)": (commands["table"], both(plain, _plant("tokenizer_config.json", "evil"))),
        "checkpoint tokenizer auto_map (export hf)": (
            ["export", "{d}/ck", "--format", "hf", "--out", "{d}/hf"],
            both(ck, _plant("tokenizer_config.json", "ck")),
        ),
        "checkpoint modeling file edited (eval)": (
            ["eval", "--model", "{d}/ck", *EVAL],
            both(
                ck, lambda d: (d / "ck/modeling_gap_pruned.py").write_text((d / "ck/modeling_gap_pruned.py").read_text() + "\nimport os\n")
            ),
        ),
        "checkpoint auto_map to another module (eval)": (
            ["eval", "--model", "{d}/ck", *EVAL],
            both(ck, bench.edit_json("ck/config.json", lambda c: c["auto_map"].update(AutoModelForCausalLM="evil.X"))),
        ),
    }
    for name, (argv, prepare) in variants.items():
        out.append(Case(name, "i34 code", argv, prepare, stdin_open=True, marker="MARKER"))
    return out


# ---- item 2: outputs over inputs ------------------------------------------------------------------
def _outputs(bench) -> list:
    Case, both, write = bench.Case, bench.both, bench.write
    table = write("t.json", bench.valid_table_text())
    history = write("cache/runs/history.sqlite", b"SQLite format 3\x00 the run history")
    cache = {"GAP_CACHE_DIR": "{d}/cache"}
    teacher = both(bench.copy_fixture("ck"), bench.copy_fixture("dp"))
    raw = {
        "report --out the run history": (
            ["report", "--table", "{d}/t.json", "--budget", "0.2", "--out", "{d}/cache/runs/history.sqlite"],
            both(table, history),
        ),
        "report --run --out the run history": (
            ["report", "--table", "{d}/t.json", "--run", "1", "--out", "{d}/cache/runs/history.sqlite"],
            both(table, history),
        ),
        "front --out inside the cache's tables": (
            ["front", "--table", "{d}/t.json", "--out", "{d}/cache/tables/f.csv"],
            both(table, history),
        ),
        "front --out the cache root": (["front", "--table", "{d}/t.json", "--out", "{d}/cache"], both(table, history)),
        "prune --out holds the cache": (
            ["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.25", "--criterion", "magnitude", "--out", "{d}"],
            both(table, history),
        ),
        "report --out = --recovered-eval": (
            ["report", "--table", "{d}/t.json", "--budget", "0.2", "--recovered-eval", "{d}/r.json", "--out", "{d}/r.json"],
            both(table, write("r.json", '{"task_accuracy": {}}')),
        ),
        "recover --out = --teacher": (["recover", "--model", "{d}/ck", "--teacher", "{d}/dp", *RECOVER, "--out", "{d}/dp"], teacher),
        "recover --out inside --teacher": (["recover", "--model", "{d}/ck", "--teacher", "{d}/dp", *RECOVER, "--out", "{d}/dp/r"], teacher),
        "recover OUT.partial = --teacher": (
            ["recover", "--model", "{d}/ck", "--teacher", "{d}/r.partial", *RECOVER, "--out", "{d}/r"],
            both(bench.copy_fixture("ck"), bench.copy_fixture("dp", "r.partial")),
        ),
        "eval --offload-dir inside --model": (
            ["eval", "--model", "{d}/ck", "--device-map", "auto", "--offload-dir", "{d}/ck/offload", *EVAL],
            bench.copy_fixture("ck"),
        ),
    }
    return [Case(name, "i34 outputs", argv, prepare, env=cache) for name, (argv, prepare) in raw.items()]


# ---- item 3: paths ------------------------------------------------------------------------------------
def _paths(bench) -> list:
    Case, both, write = bench.Case, bench.both, bench.write
    table = write("t.json", bench.valid_table_text())
    loop = both(table, lambda d: (d / "loop").symlink_to(d / "loop"))
    front = ["front", "--table", "{d}/t.json", "--out"]
    raw = {
        "--out ~nosuchuser (front)": (front + ["~nosuchuser-gap/f.csv"], table, {}),
        "--table ~nosuchuser (front)": (["front", "--table", "~nosuchuser-gap/t.json", "--out", "{d}/f.csv"], table, {}),
        "--model ~nosuchuser (eval)": (["eval", "--model", "~nosuchuser-gap/m", *EVAL], None, {}),
        "--data ~nosuchuser (table)": (
            ["table", "--model", "{fx}/tiny-llama", "--data", "~nosuchuser-gap/x.txt", "--out", "{d}/t2.json"],
            None,
            {},
        ),
        "checkpoint ~nosuchuser (export)": (["export", "~nosuchuser-gap/ck", "--out", "{d}/m.gguf"], None, {}),
        "--eval ~nosuchuser (report)": (
            ["report", "--table", "{d}/t.json", "--plan", "{d}/p.json", "--eval", "~nosuchuser-gap/e.json", "--out", "{d}/r.html"],
            both(table, write("p.json", json.dumps(bench.plan_dict()))),
            {},
        ),
        "--out a symlink loop (front)": (front + ["{d}/loop"], loop, {}),
        "--out under a symlink loop (front)": (front + ["{d}/loop/f.csv"], loop, {}),
        "--out a symlink loop (prune)": (
            ["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.25", "--criterion", "magnitude", "--out", "{d}/loop"],
            loop,
            {},
        ),
        "--table a symlink loop (front)": (["front", "--table", "{d}/loop", "--out", "{d}/f.csv"], loop, {}),
        "--out not UTF-8 (front)": (front + ["{d}/bad" + NOT_UTF8 + ".csv"], table, {}),
        "--out not UTF-8 (prune)": (
            ["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.25", "--criterion", "magnitude", "--out", "{d}/p" + NOT_UTF8],
            None,
            {},
        ),
        "--table not UTF-8 (front)": (["front", "--table", "{d}/t" + NOT_UTF8 + ".json", "--out", "{d}/f.csv"], table, {}),
        "--out 256 bytes (front)": (front + ["{d}/" + "a" * 252 + ".csv"], table, {}),
        "recover --out 250 bytes (OUT.partial 258)": (["recover", "--model", "{fx}/ck", *RECOVER, "--out", "{d}/" + "r" * 250], None, {}),
        "GAP_CACHE_DIR not UTF-8 (table)": (
            ["table", "--model", "{fx}/tiny-llama", *TABLE, "--out", "{d}/t2.json"],
            None,
            {"GAP_CACHE_DIR": "{d}/c" + NOT_UTF8},
        ),
        "GAP_CACHE_DIR ~nosuchuser (cache ls)": (["cache", "ls"], None, {"GAP_CACHE_DIR": "~nosuchuser-gap/cache"}),
        "GAP_CACHE_DIR a symlink loop (cache ls)": (["cache", "ls"], loop, {"GAP_CACHE_DIR": "{d}/loop"}),
    }
    return [Case(name, "i34 paths", argv, prepare, env=env) for name, (argv, prepare, env) in raw.items()]


# ---- item 6: names from files, foreign folders ---------------------------------------------------------
def _network_and_foreign(bench) -> list:
    Case = bench.Case

    def hub_table(d: Path) -> None:
        data = json.loads(bench.valid_table_text())
        data["spec"]["data"] = "nobody-gap/no-such-dataset:default:train"
        (d / "t.json").write_text(json.dumps(data))

    def foreign_partial(d: Path) -> None:
        (d / "foreign").mkdir()
        (d / "foreign/notes.txt").write_text("someone else's")
        (d / "r.partial").symlink_to(d / "foreign")

    def link_to_checkpoint(d: Path) -> None:
        shutil.copytree(bench.FIXTURES / "ck", d / "previous")
        (d / "link").symlink_to(d / "previous")

    in_model = {"GAP_CACHE_DIR": "{d}/ck/cache"}
    return [
        Case(
            "table spec.data a hub dataset (plan --allocator flap)",
            "i34 network+foreign",
            [
                "plan",
                "--table",
                "{d}/t.json",
                "--model",
                "{fx}/tiny-llama",
                "--allocator",
                "flap",
                "--budget",
                "0.2",
                "--out",
                "{d}/p.json",
            ],
            hub_table,
        ),
        Case(
            "table spec.data a hub dataset (compare --table)",
            "i34 network+foreign",
            [
                "compare",
                "--model",
                "{fx}/tiny-llama",
                "--table",
                "{d}/t.json",
                "--allocators",
                "dp",
                "--budgets",
                "0.2",
                "--eval-data",
                "news-sample",
                "--eval-samples",
                "2",
                "--eval-seq-len",
                "16",
                "--out",
                "{d}/c.csv",
            ],
            hub_table,
        ),
        Case(
            "OUT.partial a link to a foreign folder (recover)",
            "i34 network+foreign",
            ["recover", "--model", "{fx}/ck", *RECOVER, "--out", "{d}/r"],
            foreign_partial,
            absent=("foreign/state",),
        ),
        Case(
            "GAP_CACHE_DIR inside --model (eval)",
            "i34 network+foreign",
            ["eval", "--model", "{d}/ck", *EVAL],
            bench.copy_fixture("ck"),
            env=in_model,
            absent=("ck/cache",),
        ),
        Case(
            "GAP_CACHE_DIR inside --model (table)",
            "i34 network+foreign",
            ["table", "--model", "{d}/ck", *TABLE, "--out", "{d}/t.json"],
            bench.copy_fixture("ck"),
            env=in_model,
            absent=("ck/cache",),
        ),
        Case(
            "prune --out a link to a checkpoint",
            "i34 network+foreign",
            ["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.25", "--criterion", "magnitude", "--out", "{d}/link"],
            link_to_checkpoint,
            expect="ok",
            absent=(".link.old-*",),
        ),
    ]


# ---- item 7: what gap prints and writes ---------------------------------------------------------------
def _hygiene(bench) -> list:
    Case, write = bench.Case, bench.write
    table = write("t.json", bench.valid_table_text())

    def escape_entry(d: Path) -> None:
        key = "tiny-kl-split-fisher-0123456789abcdef0123"
        folder = d / "cache" / "tables" / key
        folder.mkdir(parents=True)
        (folder / "table.json").write_text("{}")
        spec = {"data": "\x1b[2Jwiki\x07", "n_samples": 2, "seq_len": 16, "rate_grid": [0.0, 0.5]}
        meta = {"key": key, "format_version": 2, "table_sha256": "0" * 64, "model": "tiny", "spec": spec, "created": "2026-12-03"}
        (folder / "meta.json").write_text(json.dumps(meta))

    long_name = "a" * 251 + ".csv"
    return [
        Case(
            "cache ls: a terminal escape in a cached spec",
            "i34 hygiene",
            ["cache", "ls"],
            escape_entry,
            expect="ok",
            env={"GAP_CACHE_DIR": "{d}/cache"},
        ),
        Case(
            "cache ls --json: a terminal escape in a cached spec",
            "i34 hygiene",
            ["cache", "ls", "--json"],
            escape_entry,
            expect="ok",
            env={"GAP_CACHE_DIR": "{d}/cache"},
        ),
        Case(
            "stderr on /dev/full (front, bad table)",
            "i34 hygiene",
            ["front", "--table", "{d}/absent.json", "--out", "{d}/f.csv"],
            None,
            stderr_to="/dev/full",
        ),
        Case(
            "stderr on /dev/full (front, valid)",
            "i34 hygiene",
            ["front", "--table", "{d}/t.json", "--out", "{d}/f.csv"],
            table,
            expect="ok",
            stderr_to="/dev/full",
        ),
        Case(
            "working folder deleted (eval)",
            "i34 hygiene",
            ["eval", "--model", "{fx}/tiny-llama", *EVAL],
            lambda d: (d / "gone").mkdir(),
            cwd="gone",
            cwd_gone=True,
        ),
        Case(
            "--out a 255-byte name (front)",
            "i34 hygiene",
            ["front", "--table", "{d}/t.json", "--out", "{d}/" + long_name],
            table,
            expect="ok",
            absent=(".aaaa*",),
        ),
        Case(
            "--out a 255-byte folder name (prune)",
            "i34 hygiene",
            ["prune", "--model", "{fx}/tiny-llama", "--uniform", "0.25", "--criterion", "magnitude", "--out", "{d}/" + "p" * 255],
            None,
            expect="ok",
            absent=(".pppp*",),
        ),
        Case(
            "a million identical documents (table)",
            "i34 hygiene",
            [
                "table",
                "--model",
                "{fx}/tiny-llama",
                "--data",
                "{d}/same.txt",
                *TABLE[:3],
                "8",
                *TABLE[4:],
                "--no-cache",
                "--out",
                "{d}/t2.json",
            ],
            write("same.txt", SAME_LINE * 1_000_000),
            expect="ok",
        ),
        Case(
            "a million identical documents (eval)",
            "i34 hygiene",
            ["eval", "--model", "{fx}/tiny-llama", "--data", "{d}/same.txt", "--samples", "2", "--seq-len", "2", *EVAL[4:8]],
            write("same.txt", SAME_LINE * 1_000_000),
            expect="ok",
        ),
    ]
