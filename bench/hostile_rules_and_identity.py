"""The ``i44`` families of ``bench_hostile.py`` (option rules, caches, paths, bounds, model identity),
kept apart from the other families so additions merge cleanly. ``cases(bench)`` is called with the running bench module (its ``Case``, helpers and
``FIXTURES``, read when a case is prepared); ``build_fixtures`` runs once in a child before the cases.

- **i44 rules** (item 4): the calibration-token rule of a refit, checked by ``gap table`` as by prune
  and compare; options another option or input makes moot, refused instead of ignored.
- **i44 cache** (item 5, 7b): teacher text forged to 1 of the 4 sequences asked for (checksum and
  recorded shape updated), and a file where the entry's folder belongs: both written again.
- **i44 paths** (item 6): records made with a relative ``--model`` name it absolutely; older records
  with a relative name are read against their own folder from another working folder.
- **i44 bounds** (item 7a, 7c, 7d): teacher text the cost model prices past its time bound; a disk
  that fills up inside a GGUF's tensors; gap's own GGUF given to ``gap eval``.
- **i44 identity** (items 1-3): weights edited in place with the same size and mtime, config.json
  and tokenizer edits (each must give a new table), biases stored but not declared (and declared
  but not stored). ``hostile_declared`` adds the rest of "declared = stored".
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

TINY_TABLE = ["--estimator", "fisher", "--data", "news-sample", "--samples", "2", "--seq-len", "16", "--rates", "0,0.5"]
RECOVER = [
    "--method", "lora", "--steps", "1", "--seq-len", "16", "--batch-size", "1", "--pool-windows", "2", "--no-history",
    "--no-eval-before", "--eval-samples", "1", "--eval-seq-len", "16", "--generations", "0",
]  # fmt: skip
EVAL = ["--samples", "2", "--seq-len", "16", "--no-dense", "--no-throughput", "--generations", "0", "--data", "news-sample"]
CACHE_SUFFIX = "-cache"
OWN_CACHE = {"GAP_CACHE_DIR": "{d}" + CACHE_SUFFIX}


def build_fixtures(base: Path) -> None:
    """gap's own GGUF of the uniform checkpoint (llama.cpp's deci architecture)."""
    from gap_engine.cli import main

    if main(["export", str(base / "ck"), "--out", str(base / "ck.gguf")]) != 0:
        raise RuntimeError("exporting the GGUF fixture failed")


def cases(bench) -> list:
    return _rules(bench) + _teacher_cache(bench) + _paths(bench) + _bounds(bench) + _identity(bench)


# ---- helpers ---------------------------------------------------------------------------------------
def _gap_in_child(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
    """Run one gap command in a forked child while a case is prepared (its output discarded)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.environ.update(env)
            if cwd is not None:
                os.chdir(cwd)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            from gap_engine.cli import main

            code = main(argv)
        except BaseException:
            code = 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"preparing a case: gap {' '.join(argv)} failed ({os.waitstatus_to_exitcode(status)})")


def _inside_largest_tensor(gguf: Path) -> int:
    """A file size limit half way through the largest tensor of ``gguf`` (written by numpy's tofile, which
    reports a short write without an errno), so an export of the same checkpoint stops there."""
    if not gguf.is_file():
        return 4 << 20  # the cases are listed before the fixtures exist: only a run reads the limit
    from gguf import GGUFReader

    largest = max(GGUFReader(str(gguf), "r").tensors, key=lambda t: int(t.n_bytes))
    return int(largest.data_offset) + int(largest.n_bytes) // 2


def _copy_model(bench, name: str = "m") -> Callable[[Path], None]:
    return lambda d: shutil.copytree(bench.FIXTURES / "tiny-llama", d / name)


def _own_cache(d: Path) -> Path:
    """A case's own cache, beside its folder: what the command rewrites there is no input destroyed."""
    return Path(f"{d}{CACHE_SUFFIX}")


def _teacher_entry(bench, d: Path) -> Path:
    """The cache folder of the teacher text ``teacher:64`` at 16 tokens a sequence, written by tiny-llama."""
    from gap_engine.recover.teacher_text import TeacherTextSpec, cache_key

    fingerprint = (bench.FIXTURES / "tiny-llama.fingerprint").read_text()
    return _own_cache(d) / "teacher-text" / cache_key(TeacherTextSpec(tokens=64, seq_len=16, seed=0), fingerprint, "float32")


def _forged_teacher_text(bench) -> Callable[[Path], None]:
    """A whole entry holding 1 of the 4 sequences teacher:64 asks for: checksum and recorded shape updated."""

    def prepare(d: Path) -> None:
        import numpy as np

        from gap_engine.recover.teacher_text import TeacherTextSpec

        folder = _teacher_entry(bench, d)
        folder.mkdir(parents=True)
        tokens = np.arange(100, 116, dtype=np.int32)[None, :]  # (1, 16): SmolLM2's tokenizer reads no BOS
        buffer = io.BytesIO()
        np.save(buffer, tokens, allow_pickle=False)
        (folder / "tokens.npy").write_bytes(buffer.getvalue())
        spec = TeacherTextSpec(tokens=64, seq_len=16, seed=0)
        meta = {
            "key": folder.name,
            "model_fingerprint": (bench.FIXTURES / "tiny-llama.fingerprint").read_text(),
            "dtype": "float32",
            "spec": {f: getattr(spec, f) for f in ("tokens", "seq_len", "seed", "temperature", "top_p", "batch", "version")},
            "shape": [1, 16],
            "tokens_sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
            "seconds": 0.1,
            "created": "2026-12-01T00:00:00+00:00",
        }
        (folder / "meta.json").write_text(json.dumps(meta))

    return prepare


def _file_for_teacher_entry(bench) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        entry = _teacher_entry(bench, d)
        entry.parent.mkdir(parents=True)
        entry.write_text("not a folder\n")

    return prepare


def _whole_teacher_text(bench) -> Callable[[Path], str | None]:
    """After exit 0: the entry is a folder holding the 4 sequences asked for (written again), or why not."""

    def verify(d: Path) -> str | None:
        import numpy as np

        folder = _teacher_entry(bench, d)
        if not (folder / "tokens.npy").is_file():
            return "no teacher text entry was written"
        shape = np.load(folder / "tokens.npy").shape
        return None if shape == (4, 16) else f"the run trained on a cached entry of shape {shape}, not the 4 x 16 asked for"

    return verify


def _json_field(path: str, field: str, expected: Callable[[Path], str]) -> Callable[[Path], str | None]:
    def verify(d: Path) -> str | None:
        value = json.loads((d / path).read_text()).get(field)
        return None if value == expected(d) else f"{path} records {field} {value!r}, not {expected(d)!r}"

    return verify


def _objective_kd(d: Path) -> str | None:
    recorded = json.loads((d / "other" / "r" / "recovery.json").read_text()).get("objective")
    return None if recorded == "kd" else f"trained with the {recorded} objective: the recorded base model was not found"


def _relative_base(bench) -> Callable[[Path], None]:
    """The uniform checkpoint beside a copy of its dense model ``m``, its base_model written relative ("m")
    as gap wrote it before, and a working folder ``other`` beside them."""

    def prepare(d: Path) -> None:
        shutil.copytree(bench.FIXTURES / "tiny-llama", d / "m")
        shutil.copytree(bench.FIXTURES / "ck", d / "ck")
        marker = d / "ck" / "gap_pruned.json"
        marker.write_text(json.dumps(json.loads(marker.read_text()) | {"base_model": "m"}))
        (d / "other").mkdir()

    return prepare


def _relative_table(bench) -> Callable[[Path], None]:
    def prepare(d: Path) -> None:
        shutil.copytree(bench.FIXTURES / "tiny-llama", d / "m")
        table = json.loads(bench.valid_table_text())
        (d / "t.json").write_text(json.dumps(table | {"model": "m"}))
        (d / "other").mkdir()

    return prepare


def _table_then(bench, edit: Callable[[Path], None]) -> Callable[[Path], None]:
    """A copy ``m`` of tiny-llama, its table built into the case's own cache (t1.json), then ``edit`` applied."""

    def prepare(d: Path) -> None:
        shutil.copytree(bench.FIXTURES / "tiny-llama", d / "m")
        _gap_in_child(["table", "--model", str(d / "m"), *TINY_TABLE, "--out", str(d / "t1.json")], {"GAP_CACHE_DIR": str(_own_cache(d))})
        edit(d / "m")

    return prepare


def _edit_in_place(folder: Path) -> None:
    """Every other value (odd positions) of every matrix the sampled fingerprint strides over with an
    even step (the embedding and the LM head here) times 8, written into the file in place: the same
    size, and the modification time put back."""
    import numpy as np

    path = folder / "model.safetensors"
    stat = path.stat()
    with open(path, "r+b") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(size))
        for name, info in header.items():
            count = int(np.prod(info["shape"])) if name != "__metadata__" else 0
            if not count or info["dtype"] != "F32" or max(1, count // 4096) % 2:
                continue
            start, end = (8 + size + offset for offset in info["data_offsets"])
            handle.seek(start)
            values = np.frombuffer(handle.read(end - start), dtype=np.float32).copy()
            values[1::2] *= 8.0
            handle.seek(start)
            handle.write(values.tobytes())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _edit_config(**changes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes, indent=2))

    return edit


def _edit_rope_theta(theta: float) -> Callable[[Path], None]:
    """The RoPE base the model reads: ``rope_parameters.rope_theta`` where config.json has them
    (transformers then ignores a top-level ``rope_theta``, so editing that one changes nothing),
    else the top-level ``rope_theta``."""

    def edit(folder: Path) -> None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        if isinstance(config.get("rope_parameters"), dict):
            config["rope_parameters"]["rope_theta"] = theta
        else:
            config["rope_theta"] = theta
        path.write_text(json.dumps(config, indent=2))

    return edit


def _swap_tokens(folder: Path) -> None:
    """tokenizer.json with the ids of two common words swapped: the text tokenizes to other ids."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġof"] = vocab["Ġof"], vocab["Ġthe"]
    path.write_text(json.dumps(data))


def _another_table(d: Path) -> str | None:
    """After exit 0 of a table build over the edited model: why it is the unedited model's table, or None."""
    before, after = (json.loads((d / name).read_text()) for name in ("t1.json", "t2.json"))
    if after["key"] == before["key"]:
        return "served the table of the model as it was before the edit (the same key)"
    return None


def _with_biases(bench, declared: bool, stored: bool) -> Callable[[Path], None]:
    """A copy ``m`` of tiny-llama whose q/k/v/o and MLP projections carry biases in the weights file
    (``stored``) and/or in config.json (``declared``)."""

    def prepare(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        shutil.copytree(bench.FIXTURES / "tiny-llama", d / "m")
        if stored:
            tensors = load_file(str(d / "m" / "model.safetensors"))
            for name in [n for n in tensors if n.endswith("_proj.weight")]:
                tensors[name.removesuffix("weight") + "bias"] = tensors[name][:, 0].clone().normal_(0.0, 0.5)
            save_file(tensors, str(d / "m" / "model.safetensors"), metadata={"format": "pt"})
        if declared:
            _edit_config(attention_bias=True, mlp_bias=True)(d / "m")

    return prepare


# ---- the families ------------------------------------------------------------------------------------
def _rules(bench) -> list:
    Case, write = bench.Case, bench.write
    table = write("t.json", bench.valid_table_text())
    model = ["--model", "{fx}/tiny-llama"]
    few = ["--samples", "2", "--seq-len", "32"]  # 64 tokens: fewer than tiny-llama's down_proj inputs (96)
    refit = ["--estimator", "exact", "--compensate", "refit", "--rates", "0,0.5", *few]
    plan = write("p.json", json.dumps(bench.plan_dict()))
    raw = {
        "table --compensate refit from 64 tokens": (["table", *model, *refit, "--out", "{d}/t2.json"], None),
        "compare --compensate refit from 64 tokens": (["compare", *model, "--budgets", "0.2", *refit, "--out", "{d}/c.csv"], None),
        "compare --table --samples --seq-len --compensate refit": (
            ["compare", *model, "--table", "{d}/t.json", *few, "--compensate", "refit", "--budgets", "0.2", "--out", "{d}/c.csv"],
            write("t.json", bench._table_text("spec", {"n_samples": 8})),  # 128 tokens: the table's windows fit a refit
        ),
        "compare --table --data": (["compare", *model, "--table", "{d}/t.json", "--data", "wiki-sample", "--out", "{d}/c.csv"], table),
        "compare --table --criterion": (["compare", *model, "--table", "{d}/t.json", "--criterion", "wanda", "--out", "{d}/c.csv"], table),
        "compare --table --rates --estimator": (
            ["compare", *model, "--table", "{d}/t.json", "--rates", "0,0.5", "--estimator", "exact", "--out", "{d}/c.csv"],
            table,
        ),
        "compare --evo-generations without evo": (
            ["compare", *model, "--table", "{d}/t.json", "--evo-generations", "2", "--out", "{d}/c.csv"],
            table,
        ),
        "prune --uniform --rates": (["prune", *model, "--uniform", "0.2", "--rates", "0,0.5", "--out", "{d}/o"], None),
        "prune --uniform --rounds": (["prune", *model, "--uniform", "0.2", "--rounds", "2", "--out", "{d}/o"], None),
        "plan --evo-offspring with dp": (
            ["plan", "--table", "{d}/t.json", "--budget", "0.2", "--evo-offspring", "8", "--out", "{d}/p2.json"],
            table,
        ),
        "eval --limit without --tasks": (["eval", *model, "--limit", "3"], None),
        "table --profile without --dry-run": (["table", *model, "--profile", "h100", "--out", "{d}/t2.json"], None),
        "recover --force-size without teacher text": (
            ["recover", "--model", "{fx}/ck", *RECOVER, "--data", "news-sample", "--force-size", "--out", "{d}/r"],
            None,
        ),
    }
    cases = [Case(f"{name}", "i44 rules", argv, prepare) for name, (argv, prepare) in raw.items()]
    cases.append(
        Case(
            "compare --table with the options that apply (control)",
            "i44 rules",
            ["compare", *model, "--table", "{d}/t.json", "--budgets", "0.2", "--allocators", "dp", "--compensate", "none"]
            + ["--seed", "3", "--eval-data", "news-sample", "--eval-samples", "2", "--eval-seq-len", "16", "--out", "{d}/c.csv"],
            table,
            expect="ok",
        )
    )
    cases.append(
        Case(
            "prune --plan --criterion (control: the criterion chooses the units of the plan's rates)",
            "i44 rules",
            ["prune", *model, "--plan", "{d}/p.json", "--criterion", "magnitude", "--out", "{d}/o"],
            plan,
            expect="ok",
            verify=_criterion_recorded("magnitude"),
        )
    )
    return cases


def _criterion_recorded(criterion: str):
    """After exit 0: the checkpoint's plan names the criterion that pruned it."""

    def verify(d: Path) -> str | None:
        found = json.loads((d / "o" / "plan.json").read_text()).get("criterion")
        return None if found == criterion else f"plan.json names criterion {found!r}, not {criterion!r}"

    return verify


def _teacher_cache(bench) -> list:
    Case, both = bench.Case, bench.both
    argv = ["recover", "--model", "{d}/ck", "--teacher", "{fx}/tiny-llama", *RECOVER, "--data", "teacher:64", "--out", "{d}/r"]
    env = OWN_CACHE
    return [
        Case(
            "teacher text forged to 1 of 4 sequences (checksum and shape updated)",
            "i44 cache",
            argv,
            both(bench.copy_fixture("ck"), _forged_teacher_text(bench)),
            expect="ok",
            verify=_whole_teacher_text(bench),
            env=env,
        ),
        Case(
            "a file where the teacher text entry's folder belongs",
            "i44 cache",
            argv,
            both(bench.copy_fixture("ck"), _file_for_teacher_entry(bench)),
            expect="ok",
            verify=_whole_teacher_text(bench),
            env=env,
        ),
    ]


def _paths(bench) -> list:
    Case = bench.Case
    copy = _copy_model(bench)
    absolute = lambda d: str(d / "m")  # noqa: E731
    return [
        Case(
            "prune --model m records base_model absolute",
            "i44 paths",
            ["prune", "--model", "m", "--uniform", "0.25", "--criterion", "magnitude", "--compensate", "none", "--out", "ck2"],
            copy,
            expect="ok",
            verify=_json_field("ck2/gap_pruned.json", "base_model", absolute),
        ),
        Case(
            "table --model m records model absolute",
            "i44 paths",
            ["table", "--model", "m", *TINY_TABLE, "--out", "t.json"],
            copy,
            expect="ok",
            verify=_json_field("t.json", "model", absolute),
        ),
        Case(
            "recover from another folder, base_model recorded relative (kd, not lm)",
            "i44 paths",
            ["recover", "--model", "../ck", *RECOVER, "--data", "news-sample", "--out", "r"],
            _relative_base(bench),
            expect="ok",
            verify=_objective_kd,
            cwd="other",
        ),
        Case(
            "plan --allocator flap from another folder, table model recorded relative",
            "i44 paths",
            ["plan", "--table", "../t.json", "--budget", "0.2", "--allocator", "flap", "--out", "p.json"],
            _relative_table(bench),
            expect="ok",
            cwd="other",
        ),
        Case(
            "plan --allocator slimgpt from another folder, table model recorded relative",
            "i44 paths",
            ["plan", "--table", "../t.json", "--budget", "0.2", "--allocator", "slimgpt", "--out", "p.json"],
            _relative_table(bench),
            expect="ok",
            cwd="other",
        ),
    ]


def _bounds(bench) -> list:
    Case = bench.Case
    return [
        Case(
            "recover --data teacher:1048576 on a 6M-parameter model (hours of writing)",
            "i44 bounds",
            ["recover", "--model", "{d}/ck", "--teacher", "{fx}/tiny-llama", *RECOVER, "--data", "teacher:1048576", "--out", "{d}/r"],
            bench.copy_fixture("ck"),
            absent=("r", "r.partial"),
        ),
        Case(
            "full disk inside a GGUF's tensors (export gguf)",
            "i44 bounds",
            ["export", "{fx}/ck", "--out", "{d}/out/m.gguf"],
            lambda d: (d / "out").mkdir(),
            file_limit=_inside_largest_tensor(bench.FIXTURES / "ck.gguf"),
            absent=("out/*",),
            says="cannot write {d}/out/m.gguf: File too large",
        ),
        Case(
            "eval --model on gap's own GGUF",
            "i44 bounds",
            ["eval", "--model", "{fx}/ck.gguf", *EVAL],
            None,
            says="gap export wrote for llama.cpp",
        ),
    ]


def _identity(bench) -> list:
    Case = bench.Case
    env = OWN_CACHE
    table = ["table", "--model", "{d}/m", *TINY_TABLE, "--out", "{d}/t2.json"]
    edits = {
        "weights edited in place (same size and mtime)": _edit_in_place,
        "config.json rms_norm_eps edited": _edit_config(rms_norm_eps=1e-2),
        "config.json hidden_act edited": _edit_config(hidden_act="gelu"),
        "config.json rope_theta edited": _edit_rope_theta(100.0),
        "tokenizer.json swapped": _swap_tokens,
    }
    cases = [
        Case(
            f"{name}: a new table",
            "i44 identity",
            table,
            _table_then(bench, edit),
            expect="ok",
            verify=_another_table,
            env=env,
        )
        for name, edit in edits.items()
    ]
    cases.append(
        Case(
            "weights edited in place: plan with the old table refused",
            "i44 identity",
            ["plan", "--model", "{d}/m", "--table", "{d}/t1.json", "--budget", "0.2", "--out", "{d}/p.json"],
            _table_then(bench, _edit_in_place),
            env=env,
        )
    )
    for name, (declared, stored) in {"biases stored, not declared": (False, True), "biases declared, not stored": (True, False)}.items():
        cases.append(
            Case(
                f"{name} (eval)",
                "i44 identity",
                ["eval", "--model", "{d}/m", *EVAL],
                _with_biases(bench, declared, stored),
            )
        )
    cases.append(
        Case(
            "biases stored, not declared (prune)",
            "i44 identity",
            ["prune", "--model", "{d}/m", "--uniform", "0.25", "--criterion", "magnitude", "--out", "{d}/o"],
            _with_biases(bench, False, True),
        )
    )
    return cases
