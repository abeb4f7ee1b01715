"""One validation layer for every file the tool reads: plans, loss tables, cache entries,
checkpoint metadata, converted-model markers, text sources and uploads.

A file is read in three steps, each of which can only fail with one line (a ``GapError``
subclass the caller chooses):

1. **size**: the byte count is checked against its kind's ceiling (``limits.LIMITS``)
   before anything is read, so a 10 GB file costs nothing;
2. **syntax**: JSON is parsed with its nesting bounded (``json_depth`` levels; a document
   nested 200,000 deep is refused, not a RecursionError) and its integers bounded before
   they are converted (at most ``INT_DIGITS`` digits: a 400-digit count would overflow the
   first float it meets); YAML is parsed with the safe loader, its nesting bounded the same
   way, and **aliases refused**: an alias bomb (``&a [*b, *b, ...]``) is a few hundred bytes
   that expand to gigabytes when the object is copied or written back, and no file this
   tool writes uses one. YAML builds only plain scalars, lists and maps: explicit tags
   (``!!float "abc"``, ``!!python/...``), unquoted dates and times (``created: 2024-02-30``)
   and integers longer than JSON's bound are refused;
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
from typing import Any

import yaml

from gap_engine.core.errors import CacheError, GapError, ModelLoadError, TableError, first_line
from gap_engine.core.fsutil import special_kind
from gap_engine.core.limits import LIMITS, check_at_most, check_file_size, forced

MAX_PARAMS = 10**15  # parameter counts above this are not a model (and overflow float64 exactness)
MAX_TOKENS = 1 << 40  # token positions one table cell can be measured on (far past any ceiling)
INT_DIGITS = 19  # digits of the longest integer any file may hold (int64's range); longer ones are refused unconverted


class _IntTooLong(ValueError):
    """An integer literal with more than INT_DIGITS digits."""


def _bounded_int(literal: str) -> int:
    digits = len(literal.lstrip("+-"))
    if digits > INT_DIGITS:
        raise _IntTooLong(f"holds an integer of {digits:,} digits; no file of this tool holds one past {INT_DIGITS}")
    return int(literal)


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
            kind = special_kind(path)
            reason = (
                "it is a folder" if path.is_dir() else "no such file" if not path.exists() else f"{kind or 'something'}, not a regular file"
            )
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
def depth_of(value: Any, limit: int) -> int:
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


def parse_json(text: str, what: str, error: type[GapError], max_depth: int = LIMITS.json_depth) -> Any:
    """The JSON document in ``text``, nesting at most ``max_depth`` deep; ``error`` otherwise."""
    try:
        value = json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise error(_too_deep(what, max_depth)) from None
    except _IntTooLong as exc:
        raise error(f"{what} {exc}") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise error(f"{what} is not valid JSON: {first_line(exc)}") from None
    if depth_of(value, max_depth) > max_depth:
        raise error(_too_deep(what, max_depth))
    return value


class _Refused(yaml.YAMLError):
    """A YAML construct this tool does not read (an alias, too deep a nesting)."""


class BoundedSafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader building plain scalars, lists and maps only.

    Refuses aliases, explicit tags and nesting deeper than ``max_depth``; integers longer than
    ``INT_DIGITS`` digits are refused before conversion; an unquoted date or time is refused
    before a datetime is built (so ``2024-02-30`` is one line, not a ValueError).
    """

    max_depth = LIMITS.json_depth

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            anchor = self.peek_event().anchor  # type: ignore[no-untyped-call]  # types-PyYAML leaves Parser.peek_event unannotated
            raise _Refused(f"uses the alias *{anchor}; aliases are not allowed (write the value out)")
        # None unless the document wrote a tag (peek_event: unannotated in types-PyYAML, as above)
        tag = getattr(self.peek_event(), "tag", None)  # type: ignore[no-untyped-call]
        if tag not in (None, "!"):
            raise _Refused(f"uses the tag {str(tag)[:60]}; tags are not allowed (write a plain value)")
        self._gap_depth = getattr(self, "_gap_depth", 0) + 1
        try:
            if self._gap_depth > self.max_depth:
                raise _Refused(f"nests deeper than {self.max_depth} levels")
            return super().compose_node(parent, index)
        finally:
            self._gap_depth -= 1


def _construct_bounded_int(loader: BoundedSafeLoader, node: Any) -> Any:
    literal = str(node.value).replace("_", "")
    digits = len(literal.lstrip("+-"))
    if digits > INT_DIGITS:
        raise _Refused(f"holds an integer of {digits:,} digits; no file of this tool holds one past {INT_DIGITS}")
    return yaml.SafeLoader.construct_yaml_int(loader, node)


BoundedSafeLoader.add_constructor("tag:yaml.org,2002:int", _construct_bounded_int)


def _refuse_timestamp(loader: BoundedSafeLoader, node: Any) -> Any:
    raise _Refused(f"holds the date or time {str(node.value)[:40]}; no field of this tool is one (write it in quotes as text)")


BoundedSafeLoader.add_constructor("tag:yaml.org,2002:timestamp", _refuse_timestamp)


def parse_yaml(text: str, what: str, error: type[GapError]) -> Any:
    """The single YAML document in ``text``: safe types only, no aliases, bounded nesting."""
    try:
        return yaml.load(text, Loader=BoundedSafeLoader)
    except _Refused as exc:
        raise error(f"{what} {exc}") from None
    except RecursionError:
        raise error(_too_deep(what, LIMITS.json_depth)) from None
    except yaml.YAMLError as exc:
        raise error(f"{what} is not valid YAML: {first_line(exc)}") from None
    except (ValueError, TypeError, OverflowError) as exc:  # a constructor's own complaint about a scalar
        raise error(f"{what} holds a value YAML cannot read: {first_line(exc)}") from None


def parse_json_or_yaml(text: str, what: str, error: type[GapError], name: str = "") -> Any:
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


def read_json_file(path: str | Path, limit: int, what: str, error: type[GapError]) -> Any:
    """Size, decode and parse a JSON file in one call (see the module docstring)."""
    return parse_json(decode_text(read_bounded(path, limit, what, error), what, error), what, error)


# ---- step 3: fields ----------------------------------------------------------------------------
def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def check_int(value: object, name: str, error: type[GapError], low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is an integer (not a bool, not a float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = value if isinstance(value, (int, float)) else _type_name(value)
        raise error(f"{name} must be an integer, got {shown}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (
            f"between {low:,} and {high:,}"
            if low is not None and high is not None
            else f">= {low:,}"
            if low is not None
            else f"<= {high:,}"
        )
        raise error(f"{name} must be {bounds}, got {value:,}")
    return value


def check_number(value: object, name: str, error: type[GapError], low: float | None = None, high: float | None = None) -> float:
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


def check_text(value: object, name: str, error: type[GapError], optional: bool = False, max_len: int = LIMITS.text_field) -> str | None:
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


def check_keys(data: Any, name: str, error: type[GapError]) -> dict[str, Any]:
    """``data`` if it is an object whose keys are all text."""
    if not isinstance(data, dict):
        raise error(f"{name} must be an object, got {_type_name(data)}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise error(f"{name} has a key that is not text: {str(bad[0])[:40]!r}")
    return data


def check_matrix(
    value: object,
    name: str,
    shape: tuple[int, int],
    error: type[GapError],
    low: float | None = None,
    whole: bool = False,
    high: float | None = None,
) -> None:
    """A (rows, cols) list of lists of finite numbers in [``low``, ``high``], whole numbers if ``whole``."""
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
            if high is not None and number > high:
                raise error(f"{name}[{i}][{j}] = {number:g} is above {high:g}, which no table can hold")
            if whole and number != int(number):
                raise error(f"{name}[{i}][{j}] = {number:g} is not a whole number")


# ---- documents ---------------------------------------------------------------------------------
_TABLE_KINDS = {"split": 2, "block": 1}


def check_table_document(data: Any) -> None:
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
    for i, entry in enumerate(components):
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], str):
            raise TableError(f"{what} components[{i}] must be [layer, kind]")
        check_int(entry[0], f"{what} components[{i}] layer", TableError, 0, layers - 1)
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
    if data.get("estimate") is not None:
        check_matrix(data["estimate"], f"{what} estimate", shape, TableError)
    if data.get("cell_tokens") is not None:
        check_matrix(data["cell_tokens"], f"{what} cell_tokens", shape, TableError, low=0.0, whole=True, high=float(MAX_TOKENS))
    if data.get("measured") is not None:
        flags = data["measured"]
        if not isinstance(flags, list) or len(flags) != shape[0] or any(not isinstance(row, list) or len(row) != shape[1] for row in flags):
            raise TableError(f"{what} measured must list {shape[0]} rows of {shape[1]} true/false values")
        if any(cell not in (True, False, 0, 1) or isinstance(cell, float) for row in flags for cell in row):
            raise TableError("malformed loss table: measured must hold true/false per cell")


def _check_table_spec(spec: dict[str, Any]) -> None:
    what = "loss table spec"
    check_keys(spec, what, TableError)
    for name in ("data", "criterion", "objective", "mode", "estimator", "method", "compensation"):
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
    if "rate_grid" in spec:
        if not isinstance(spec["rate_grid"], list) or len(spec["rate_grid"]) > LIMITS.rates:
            raise TableError(f"{what} rate_grid must list at most {LIMITS.rates} rates")
        for rate in spec["rate_grid"]:
            check_number(rate, f"{what} rate_grid entry", TableError, 0.0, 1.0)


def check_cache_meta(meta: object, key: str) -> dict[str, Any]:
    """CacheError unless a cache entry's meta.json is an object naming ``key`` with a sha256 and a spec."""
    meta = check_keys(meta, "meta.json", CacheError)
    if meta.get("key") != key:
        raise CacheError(f"meta.json names the key {str(meta.get('key'))[:80]!r}")
    digest = meta.get("table_sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        raise CacheError("meta.json has no valid table_sha256")
    for name in ("model", "created"):
        check_text(meta.get(name), f"meta.json {name}", CacheError, optional=True)
    if not isinstance(meta.get("spec", {}), dict):
        raise CacheError("meta.json spec must be an object")
    try:  # `gap cache ls` shows the spec's fields: held to a table file's rules
        _check_table_spec(meta.get("spec", {}))
    except TableError as exc:
        raise CacheError(f"meta.json {exc}") from None
    if "build_seconds" in meta and meta["build_seconds"] is not None:
        check_number(meta["build_seconds"], "meta.json build_seconds", CacheError, low=0.0)
    return meta


def check_pruned_marker(marker: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelLoadError unless a checkpoint's gap_pruned.json holds fields of the right types."""
    what = f"{where}/gap_pruned.json"
    check_keys(marker, what, ModelLoadError)
    check_int(marker.get("format_version"), f"{what} format_version", ModelLoadError, 1)
    for name in ("base_model", "base_fingerprint", "fingerprint", "plan_hash"):
        check_text(marker.get(name), f"{what} {name}", ModelLoadError, optional=True)
    if marker.get("param_count") is not None:
        check_int(marker["param_count"], f"{what} param_count", ModelLoadError, 1, MAX_PARAMS)
    if marker.get("fingerprint_format") is not None:
        check_int(marker["fingerprint_format"], f"{what} fingerprint_format", ModelLoadError, 1, 1 << 16)
    compensation = marker.get("compensation")
    if compensation is not None:
        check_keys(compensation, f"{what} compensation", ModelLoadError)
        check_text(compensation.get("mode"), f"{what} compensation mode", ModelLoadError, max_len=64)
        if len(json.dumps(compensation, default=str)) > 4096:
            raise ModelLoadError(f"{what} compensation is too large to be a compensation record")
    return marker


def check_per_layer_config(per_layer: Any, num_layers: object, where: str) -> list[dict[str, Any]]:
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


def _check_scores(value: object, what: str, error: type[GapError], low: float | None = None) -> dict[str, Any]:
    """An object of source name -> finite number (a perplexity, KL or agreement per source)."""
    value = check_keys(value, what, error)
    for name, number in value.items():
        check_text(name, f"{what} source name", error)
        check_number(number, f"{what}[{name!r}]", error, low=low)
    return value


def _check_task_scores(value: Any, what: str, error: type[GapError]) -> dict[str, Any]:
    """Task name -> {acc, acc_stderr, acc_norm, acc_norm_stderr, n, ...}: accuracies in [0, 1], n a count."""
    check_keys(value, what, error)
    if len(value) > 256:
        raise error(f"{what} names more than 256 tasks")
    for name, score in value.items():
        check_text(name, f"{what} task name", error)
        check_keys(score, f"{what}[{name!r}]", error)
        check_number(score.get("acc"), f"{what}[{name!r}] acc", error, low=0.0, high=1.0)
        for metric in ("acc_stderr", "acc_norm", "acc_norm_stderr"):
            if score.get(metric) is not None:
                check_number(score[metric], f"{what}[{name!r}] {metric}", error, low=0.0, high=1.0)
        check_int(score.get("n"), f"{what}[{name!r}] n", error, 1, 10**9)
    checked: dict[str, Any] = value
    return checked


def check_evaluation_report(data: object, what: str, error: type[GapError]) -> dict[str, Any]:
    """``data`` unless it is not what ``gap eval --json`` prints (``EvalReport.to_dict()``).

    Only the fields a report shows are checked, each where it is present: per-source scores
    are finite numbers under short names, parameter counts whole numbers, generations short
    lists of texts.
    """
    data = check_keys(data, what, error)
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
    for name in ("task_accuracy", "dense_task_accuracy"):
        if data.get(name) is not None:
            _check_task_scores(data[name], f"{what} {name}", error)
    generations = data.get("generations") or []
    if not isinstance(generations, list) or len(generations) > LIMITS.generations:
        raise error(f"{what} generations must be a list of at most {LIMITS.generations} entries")
    for i, entry in enumerate(generations):
        check_keys(entry, f"{what} generations[{i}]", error)
        for name in ("prompt", "model", "dense"):
            if entry.get(name) is not None and (not isinstance(entry[name], str) or len(entry[name]) > GENERATION_CHARS):
                raise error(f"{what} generations[{i}] {name} must be a text of at most {GENERATION_CHARS:,} characters")
    return data


KEPT_INDEX_KEYS = ("kept_kv_heads", "kept_heads", "kept_channels")


def check_kept_indices(data: Any, what: str, error: type[GapError]) -> dict[str, Any]:
    """``data`` unless it is not a checkpoint's ``kept_indices.json``: per key of ``KEPT_INDEX_KEYS``
    one list per block of distinct non-negative unit indices, every key listing the same blocks."""
    check_keys(data, what, error)
    blocks = None
    for key in KEPT_INDEX_KEYS:
        rows = data.get(key)
        if not isinstance(rows, list) or len(rows) > LIMITS.layers:
            raise error(f"{what} {key} must be a list of at most {LIMITS.layers} per-block lists")
        if blocks is not None and len(rows) != blocks:
            raise error(f"{what} {key} lists {len(rows)} blocks, {KEPT_INDEX_KEYS[0]} {blocks}")
        blocks = len(rows)
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) > 1 << 24:
                raise error(f"{what} {key}[{i}] must be a list of unit indices")
            for index in row:
                check_int(index, f"{what} {key}[{i}] entry", error, 0, (1 << 24) - 1)
            if len(set(row)) != len(row):
                raise error(f"{what} {key}[{i}] lists a unit twice")
    checked: dict[str, Any] = data
    return checked


def read_kept_indices(folder: str | Path, error: type[GapError]) -> dict[str, Any]:
    """A checkpoint's ``kept_indices.json``, through every step of this module."""
    path = Path(folder) / "kept_indices.json"
    return check_kept_indices(read_json_file(path, LIMITS.metadata_bytes * 16, str(path), error), str(path), error)


def read_evaluation_file(path: str | Path, error: type[GapError]) -> dict[str, Any]:
    """An evaluation report file (``eval_report.json``, ``gap eval --json``), checked like an upload."""
    what = str(path)
    return check_evaluation_report(read_json_file(path, LIMITS.metadata_bytes, what, error), what, error)
