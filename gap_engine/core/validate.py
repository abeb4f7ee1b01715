"""One validation layer for every file the tool reads: plans, loss tables, cache entries,
checkpoint metadata, converted-model markers, text sources and uploads.

A file is read in three steps, each of which can only fail with one line (a ``GapError``
subclass the caller chooses):

1. **size**: the byte count is checked against its kind's ceiling (``limits.LIMITS``)
   before anything is read, so a 10 GB file costs nothing;
2. **syntax**: JSON is parsed with its nesting bounded (``json_depth`` levels; a document
   nested 200,000 deep is refused, not a RecursionError); YAML is parsed with the safe
   loader, its nesting bounded the same way, and **aliases refused**: an alias bomb
   (``&a [*b, *b, ...]``) is a few hundred bytes that expand to gigabytes when the object
   is copied or written back, and no file this tool writes uses one;
3. **fields**: types, ranges and sizes of what the document holds (integers are integers,
   numbers are finite, text fields are short single lines), checked by the helpers here
   and by the document checks at the end of this module.

The same functions serve the CLI and the app, so an upload is held to the same rules as a
file on disk.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from gap_engine.core.errors import CacheError, GapError, ModelLoadError, TableError, first_line
from gap_engine.core.limits import LIMITS, check_at_most, check_file_size, forced

MAX_PARAMS = 10**15  # parameter counts above this are not a model (and overflow float64 exactness)


# ---- step 1: size ------------------------------------------------------------------------------
def read_bounded(path: str | Path, limit: int, what: str, error: type[GapError]) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; ``error`` (one line) otherwise.

    Args:
        path: the file.
        limit: its ceiling in bytes (a field of ``LIMITS``).
        what: how the message names it, e.g. "plan plan.yaml".
        error: the GapError subclass to raise.
    """
    path = Path(path)
    try:
        if not path.is_file():
            reason = "it is a folder" if path.is_dir() else "no such file" if not path.exists() else "not a regular file"
            raise error(f"cannot read {what}: {reason}")
        check_file_size(path.stat().st_size, limit, what, error)
        with open(path, "rb") as handle:
            data = handle.read() if forced() else handle.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {what}: {exc.strerror or first_line(exc)}") from None
    check_file_size(len(data), limit, what, error)  # the file grew while it was read
    return data


def decode_text(data: bytes, what: str, error: type[GapError]) -> str:
    """UTF-8 text (a BOM is dropped); ``error`` for other encodings or binary data."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if "\x00" in text:
        raise error(f"{what} holds NUL bytes: it is a binary file, not text")
    return text


# ---- step 2: syntax ----------------------------------------------------------------------------
def depth_of(value, limit: int) -> int:
    """Nesting depth of lists and dicts (a scalar is 0), counted without recursion up to ``limit + 1``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (list, tuple, dict)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children if isinstance(child, (list, tuple, dict)))
    return deepest


def _too_deep(what: str, limit: int) -> str:
    return f"{what} nests lists/objects deeper than {limit} levels; no file of this tool does"


def parse_json(text: str, what: str, error: type[GapError], max_depth: int = LIMITS.json_depth):
    """The JSON document in ``text``, nesting at most ``max_depth`` deep; ``error`` otherwise."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(_too_deep(what, max_depth)) from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise error(f"{what} is not valid JSON: {first_line(exc)}") from None
    if depth_of(value, max_depth) > max_depth:
        raise error(_too_deep(what, max_depth))
    return value


class _Refused(yaml.YAMLError):
    """A YAML construct this tool does not read (an alias, too deep a nesting)."""


class BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses aliases and nesting deeper than ``max_depth``."""

    max_depth = LIMITS.json_depth

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            anchor = self.peek_event().anchor
            raise _Refused(f"uses the alias *{anchor}; aliases are not allowed (write the value out)")
        self._gap_depth = getattr(self, "_gap_depth", 0) + 1
        try:
            if self._gap_depth > self.max_depth:
                raise _Refused(f"nests deeper than {self.max_depth} levels")
            return super().compose_node(parent, index)
        finally:
            self._gap_depth -= 1


def parse_yaml(text: str, what: str, error: type[GapError]):
    """The single YAML document in ``text``: safe types only, no aliases, bounded nesting."""
    try:
        return yaml.load(text, Loader=BoundedSafeLoader)  # noqa: S506 - a SafeLoader subclass
    except _Refused as exc:
        raise error(f"{what} {exc}") from None
    except RecursionError:
        raise error(_too_deep(what, LIMITS.json_depth)) from None
    except yaml.YAMLError as exc:
        raise error(f"{what} is not valid YAML: {first_line(exc)}") from None


def parse_json_or_yaml(text: str, what: str, error: type[GapError], name: str = ""):
    """JSON for a ``.json`` name or text that starts like JSON, YAML for ``.yaml``/``.yml``.

    Text named neither way that starts with ``{`` or ``[`` and is not valid JSON is tried as
    YAML (flow style), and reports the JSON error if that fails too: a truncated JSON file
    is described as broken JSON, not with a YAML parser's complaint.
    """
    suffix = Path(name).suffix.lower() if name else ""
    if suffix == ".json":
        return parse_json(text, what, error)
    if suffix in (".yaml", ".yml"):
        return parse_yaml(text, what, error)
    if text.lstrip()[:1] in ("{", "["):
        try:
            return parse_json(text, what, error)
        except GapError as json_error:
            try:
                return parse_yaml(text, what, error)
            except GapError:
                raise json_error from None
    return parse_yaml(text, what, error)


def read_json_file(path: str | Path, limit: int, what: str, error: type[GapError]):
    """Size, decode and parse a JSON file in one call (see the module docstring)."""
    return parse_json(decode_text(read_bounded(path, limit, what, error), what, error), what, error)


# ---- step 3: fields ----------------------------------------------------------------------------
def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def check_int(value, name: str, error: type[GapError], low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is an integer (not a bool, not a float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = value if isinstance(value, (int, float)) else _type_name(value)
        raise error(f"{name} must be an integer, got {shown}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low:,} and {high:,}" if low is not None and high is not None else f">= {low:,}" if low is not None else f"<= {high:,}"
        raise error(f"{name} must be {bounds}, got {value:,}")
    return value


def check_number(value, name: str, error: type[GapError], low: float | None = None, high: float | None = None) -> float:
    """``value`` as a float if it is a finite number (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be a number, got {_type_name(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise error(f"{name} must be a finite number, got {value}")
    if (low is not None and number < low) or (high is not None and number > high):
        raise error(f"{name} = {number:g} is outside [{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]")
    return number


def check_text(value, name: str, error: type[GapError], optional: bool = False, max_len: int = LIMITS.text_field) -> str | None:
    """``value`` if it is a short single line of printable text (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise error(f"{name} must be a text of at most {max_len} characters, got {_type_name(value)}")
    if len(value) > max_len:
        raise error(f"{name} must be a text of at most {max_len} characters, got {len(value):,}")
    if not value.isprintable():
        raise error(f"{name} must be one line of printable text (no control characters)")
    return value


def check_keys(data: dict, name: str, error: type[GapError]) -> dict:
    """``data`` if it is an object whose keys are all text."""
    if not isinstance(data, dict):
        raise error(f"{name} must be an object, got {_type_name(data)}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise error(f"{name} has a key that is not text: {str(bad[0])[:40]!r}")
    return data


def check_matrix(value, name: str, shape: tuple[int, int], error: type[GapError], low: float | None = None, whole: bool = False) -> None:
    """A (rows, cols) list of lists of finite numbers, each >= ``low``, whole numbers if ``whole``."""
    rows, cols = shape
    if not isinstance(value, list) or len(value) != rows:
        got = len(value) if isinstance(value, list) else _type_name(value)
        raise error(f"{name} must list {rows} rows, got {got}")
    for i, row in enumerate(value):
        if not isinstance(row, list) or len(row) != cols:
            got = len(row) if isinstance(row, list) else _type_name(row)
            raise error(f"{name}[{i}] must list {cols} numbers, got {got}")
        for j, cell in enumerate(row):
            number = check_number(cell, f"{name}[{i}][{j}]", error)
            if low is not None and number < low:
                raise error(f"{name}[{i}][{j}] = {number:g} is below {low:g}, which no table can hold")
            if whole and number != int(number):
                raise error(f"{name}[{i}][{j}] = {number:g} is not a whole number")


# ---- documents ---------------------------------------------------------------------------------
_TABLE_KINDS = {"split": 2, "block": 1}


def check_table_document(data) -> None:
    """TableError (one line) unless a loss-table file's values are sane.

    Checks what ``LossTable`` parsing alone would accept but no measured table can hold:
    counts that are not integers (``num_layers: 1e999``), a non-positive ``dense_prunable``,
    cells that remove more than the model has (``removed: 1e30``) or negative smoothed
    losses, a row count that is not every layer's components, and window sizes past the
    ceilings (the spec's windows are read again by some allocators).
    """
    if not isinstance(data, dict):
        return  # the parser's own message ("expected a JSON object")
    check_keys(data, "loss table", TableError)
    what = "loss table"
    for name in ("model", "model_fingerprint", "key", "data_fingerprint"):
        if name in data:
            check_text(data[name], f"{what} {name}", TableError)
    layers = check_int(data.get("num_layers"), f"{what} num_layers", TableError, 1, LIMITS.layers)
    prunable = check_int(data.get("dense_prunable"), f"{what} dense_prunable", TableError, 1, MAX_PARAMS)
    for name in ("dense_objective", "build_seconds"):
        if name in data:
            check_number(data[name], f"{what} {name}", TableError, low=0.0 if name == "build_seconds" else None)
    spec = data.get("spec")
    if isinstance(spec, dict):
        _check_table_spec(spec)
    grid = data.get("rate_grid")
    if not isinstance(grid, list) or not 2 <= len(grid) <= LIMITS.rates:
        raise TableError(f"{what} rate_grid must list 2 to {LIMITS.rates} rates")
    kinds = _TABLE_KINDS.get(spec.get("mode", "split") if isinstance(spec, dict) else "split", 2)
    components = data.get("components")
    if not isinstance(components, list) or len(components) != layers * kinds:
        got = len(components) if isinstance(components, list) else _type_name(components)
        raise TableError(f"{what} components must list {layers * kinds} rows ({layers} layers x {kinds}), got {got}")
    shape = (len(components), len(grid))
    for name in ("delta", "cell_objective"):
        check_matrix(data.get(name), f"{what} {name}", shape, TableError)
    if data.get("smoothed") is not None:
        check_matrix(data["smoothed"], f"{what} smoothed", shape, TableError, low=0.0)
    check_matrix(data.get("removed"), f"{what} removed", shape, TableError, low=0.0, whole=True)
    largest = max((max(row) for row in data["removed"]), default=0)
    if largest > prunable:
        raise TableError(f"{what} removes {largest:g} parameters in one cell, more than its dense_prunable {prunable:,}")
    if "extras" in data and not isinstance(data["extras"], dict):
        raise TableError(f"{what} extras must be an object")


def _check_table_spec(spec: dict) -> None:
    what = "loss table spec"
    check_keys(spec, what, TableError)
    for name in ("data", "criterion", "objective", "mode", "estimator", "method"):
        if name in spec:
            check_text(spec[name], f"{what} {name}", TableError)
    sizes = (("n_samples", 1, LIMITS.samples), ("seq_len", 2, LIMITS.seq_len), ("batch_size", 1, LIMITS.batch_size))
    for name, low, high in sizes:
        if name in spec:
            check_int(spec[name], f"{what} {name}", TableError, low)
            check_at_most(spec[name], high, f"{what} {name} {spec[name]:,}", from_file=True)
    if "seed" in spec:
        check_int(spec["seed"], f"{what} seed", TableError, 0, LIMITS.seed)
    if "channel_multiple" in spec:
        check_int(spec["channel_multiple"], f"{what} channel_multiple", TableError, 1, LIMITS.channel_multiple)
    if "rate_grid" in spec and (not isinstance(spec["rate_grid"], list) or len(spec["rate_grid"]) > LIMITS.rates):
        raise TableError(f"{what} rate_grid must list at most {LIMITS.rates} rates")


def check_cache_meta(meta, key: str) -> dict:
    """CacheError unless a cache entry's meta.json is an object naming ``key`` with a sha256 and a spec."""
    check_keys(meta, "meta.json", CacheError)
    if meta.get("key") != key:
        raise CacheError(f"meta.json names the key {str(meta.get('key'))[:80]!r}")
    digest = meta.get("table_sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        raise CacheError("meta.json has no valid table_sha256")
    for name in ("model", "created"):
        check_text(meta.get(name), f"meta.json {name}", CacheError, optional=True)
    if not isinstance(meta.get("spec", {}), dict):
        raise CacheError("meta.json spec must be an object")
    if "build_seconds" in meta and meta["build_seconds"] is not None:
        check_number(meta["build_seconds"], "meta.json build_seconds", CacheError, low=0.0)
    return meta


def check_pruned_marker(marker: dict, where: str) -> dict:
    """ModelLoadError unless a checkpoint's gap_pruned.json holds fields of the right types."""
    what = f"{where}/gap_pruned.json"
    check_keys(marker, what, ModelLoadError)
    check_int(marker.get("format_version"), f"{what} format_version", ModelLoadError, 1)
    for name in ("base_model", "base_fingerprint", "fingerprint"):
        check_text(marker.get(name), f"{what} {name}", ModelLoadError, optional=True)
    if marker.get("param_count") is not None:
        check_int(marker["param_count"], f"{what} param_count", ModelLoadError, 1, MAX_PARAMS)
    return marker


def check_per_layer_config(per_layer, num_layers, where: str) -> list[dict]:
    """The per-block widths of a checkpoint's config.json, in block order; ModelLoadError otherwise.

    Args:
        per_layer: config.json's ``per_layer_config``: {"0": {...}, "1": {...}, ...}.
        num_layers: config.json's ``num_hidden_layers``.
        where: the checkpoint folder, for messages.
    """
    what = f"{where}/config.json per_layer_config"
    if not isinstance(per_layer, dict) or not per_layer:
        raise ModelLoadError(f"{where}/config.json has no per_layer_config")
    layers = check_int(num_layers, f"{where}/config.json num_hidden_layers", ModelLoadError, 1, LIMITS.layers)
    missing = [str(i) for i in range(layers) if str(i) not in per_layer]
    if missing:
        raise ModelLoadError(f"{what} has no entry for layer {missing[0]}")
    if len(per_layer) != layers:
        raise ModelLoadError(f"{what} lists {len(per_layer)} layers, but num_hidden_layers is {layers}")
    widths = []
    for i in range(layers):
        entry = check_keys(per_layer[str(i)], f"{what}[{i}]", ModelLoadError)
        heads = check_int(entry.get("num_attention_heads"), f"{what}[{i}] num_attention_heads", ModelLoadError, 1, 1 << 16)
        kv = check_int(entry.get("num_key_value_heads"), f"{what}[{i}] num_key_value_heads", ModelLoadError, 1, heads)
        check_int(entry.get("intermediate_size"), f"{what}[{i}] intermediate_size", ModelLoadError, 1, 1 << 24)
        if heads % kv:
            raise ModelLoadError(f"{what}[{i}]: {heads} heads do not split into {kv} KV groups")
        widths.append(entry)
    return widths


GENERATION_CHARS = 100_000  # one generated text of an evaluation report (64 greedy tokens are ~500 characters)


def _check_scores(value, what: str, error: type[GapError], low: float | None = None) -> dict:
    """An object of source name -> finite number (a perplexity, KL or agreement per source)."""
    check_keys(value, what, error)
    for name, number in value.items():
        check_text(name, f"{what} source name", error)
        check_number(number, f"{what}[{name!r}]", error, low=low)
    return value


def check_evaluation_report(data, what: str, error: type[GapError]) -> dict:
    """``data`` unless it is not what ``gap eval --json`` prints (``EvalReport.to_dict()``).

    Only the fields a report shows are checked, each where it is present: per-source scores
    are finite numbers under short names, parameter counts whole numbers, generations short
    lists of texts.
    """
    check_keys(data, what, error)
    if not isinstance(data.get("perplexity"), dict) or not data["perplexity"]:
        raise error(f"{what} is not an evaluation report (no 'perplexity' object): make it with `gap eval --json`")
    _check_scores(data["perplexity"], f"{what} perplexity", error, low=0.0)
    for name in ("kl_to_dense", "top1_agreement"):
        if data.get(name) is not None:
            _check_scores(data[name], f"{what} {name}", error)
    if data.get("params") is not None:
        check_int(data["params"], f"{what} params", error, 1, MAX_PARAMS)
    if data.get("dense") is not None:
        dense = check_keys(data["dense"], f"{what} dense", error)
        if dense.get("params") is not None:
            check_int(dense["params"], f"{what} dense params", error, 1, MAX_PARAMS)
        if dense.get("perplexity") is not None:
            _check_scores(dense["perplexity"], f"{what} dense perplexity", error, low=0.0)
    if data.get("throughput") is not None:
        throughput = check_keys(data["throughput"], f"{what} throughput", error)
        for name in ("prefill_speedup", "decode_speedup"):
            if throughput.get(name) is not None:
                check_number(throughput[name], f"{what} throughput {name}", error, low=0.0)
    generations = data.get("generations") or []
    if not isinstance(generations, list) or len(generations) > LIMITS.generations:
        raise error(f"{what} generations must be a list of at most {LIMITS.generations} entries")
    for i, entry in enumerate(generations):
        check_keys(entry, f"{what} generations[{i}]", error)
        for name in ("prompt", "model", "dense"):
            if entry.get(name) is not None and (not isinstance(entry[name], str) or len(entry[name]) > GENERATION_CHARS):
                raise error(f"{what} generations[{i}] {name} must be a text of at most {GENERATION_CHARS:,} characters")
    return data
