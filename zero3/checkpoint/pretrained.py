"""Load a plain (non-ZeRO) state dict or a ``.safetensors`` file into a partitioned model.

Each rank copies only its own slice of each tensor into its shard: from a ``.safetensors`` file it
reads just those bytes (the file's header says where every tensor lies), so no rank ever holds a full
tensor, let alone the whole model. This is how fine-tuning starts from pretrained weights::

    with zero3.Init():
        model = GPT(cfg)
    zero3.pretrained.load_state_dict(model, "gpt.safetensors")   # or a dict, a .pt file, an index

A module's extra state (``<prefix>._extra_state``, any value, from a mapping or a ``.pt`` file) goes to
its ``set_extra_state``, as ``nn.Module.load_state_dict`` hands it.

Every check (missing and unexpected keys, shapes) runs on every rank before the first parameter
changes; the ranks agree on the outcome, so they raise the same error together.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
from torch import nn

from .safetensors import SafetensorsHeader, read_safetensors_header, read_tensor_range
from .exchange import exchange
from .layout import EXTRA_STATE_KEY, extra_state_modules, state_tensors
from .load_hooks import warn_skipped_hooks
from ..runtime.context import RuntimeContext
from ..errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
                      ZeroStateError)
from ..partition.param import ZeroParameter
from ..partition.state import ParamStatus

logger = logging.getLogger(__name__)


class LoadResult(NamedTuple):
    """Keys the model expected but the source lacked, and keys of the source the model does not have."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# -- sources --------------------------------------------------------------------------------------
class _Source:
    """Tensors by name: shape, dtype, and reading a flat element range (or the whole tensor)."""

    aliases: dict[str, str]

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, key: str, lo: int, dest: torch.Tensor) -> None:
        """Copy flat elements ``[lo, lo + dest.numel())`` of ``key`` into ``dest`` (cast as needed)."""
        raise NotImplementedError

    def problem(self, key: str) -> str | None:
        """Why ``key``'s value cannot be loaded (checked before anything is copied), or None."""
        return None

    def extra_state(self) -> dict[str, Any]:
        """The values under extra-state keys (``<prefix>._extra_state``), not among `keys`."""
        return {}

    def other_keys(self) -> list[str]:
        """Top-level keys whose value is not a tensor (a nested dict, a list): unexpected unless the
        model names them, as torch reports them."""
        return []

    def holder_of(self, keys: list[str]) -> tuple[str, int] | None:
        """(the top-level key of the nested mapping holding most of ``keys``, how many), or None: a
        ``{"model": sd, "optimizer": ...}`` checkpoint handed whole."""
        return None

    def close(self) -> None:
        pass


class _DictSource(_Source):
    def __init__(self, sd: Mapping[str, Any]) -> None:
        self.extra = {k: v for k, v in sd.items() if k == EXTRA_STATE_KEY or k.endswith("." + EXTRA_STATE_KEY)}
        self.sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and k not in self.extra}
        # other values (a list, an array) are not keys; a model key that names one is reported as
        # such, not as missing
        self.others = {k: type(v).__name__ for k, v in sd.items()
                       if not isinstance(v, torch.Tensor) and k not in self.extra}
        self.nested = {k: v for k, v in sd.items() if isinstance(v, Mapping) and k not in self.extra}
        self.aliases = {}

    def extra_state(self) -> dict[str, Any]:
        return self.extra

    def other_keys(self) -> list[str]:
        return list(self.others)

    def holder_of(self, keys: list[str]) -> tuple[str, int] | None:
        found = [(sum(k in v for k in keys), name) for name, v in self.nested.items()]
        best = max(found, default=(0, ""))
        return (best[1], best[0]) if best[0] else None

    def problem(self, key: str) -> str | None:
        if key in self.others:
            return f"a {self.others[key]}, not a tensor"
        t = self.sd.get(key)
        return "a meta tensor, which holds no data" if t is not None and t.is_meta else None

    def keys(self) -> list[str]:
        return list(self.sd)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.sd[key].shape)

    def read(self, key: str, lo: int, dest: torch.Tensor) -> None:
        flat = self.sd[key].detach().reshape(-1)
        dest.copy_(flat[lo: lo + dest.numel()].view(dest.shape))


class _SafetensorsSource(_Source):
    def __init__(self, paths: dict[str, Path]) -> None:
        """``paths``: key -> file (one file, or the weight map of a sharded index)."""
        self.headers: dict[Path, SafetensorsHeader] = {}
        self.where: dict[str, Path] = {}
        self.aliases = {}
        self._handles: dict[Path, BinaryIO] = {}
        for path in dict.fromkeys(paths.values()):
            if not path.is_file():
                raise CheckpointNotFoundError(f"{path}: safetensors file does not exist")
            header = read_safetensors_header(path)
            self.headers[path] = header
            raw = header.metadata.get("zero3_aliases")
            if raw:
                try:
                    self.aliases.update(json.loads(raw))
                except ValueError:
                    raise CheckpointCorruptError(f"{path}: __metadata__['zero3_aliases'] is not JSON") from None
        for key, path in paths.items():
            if key not in self.headers[path].entries:
                raise CheckpointCorruptError(f"{path}: tensor {key!r} listed in the index is not in the file")
            self.where[key] = path

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.headers[self.where[key]].entries[key].shape

    def read(self, key: str, lo: int, dest: torch.Tensor) -> None:
        path = self.where[key]
        fh = self._handles.get(path)
        if fh is None:
            fh = self._handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        read_tensor_range(fh, self.headers[path], key, lo, dest)

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()


class RenamedSource(_Source):
    """Another source's tensors under new names (``{new: old}``); names not in the map are dropped.

    How a checkpoint written with other key names (Hugging Face's renamings, a base model's prefix)
    is read without copying it."""

    def __init__(self, inner: _Source, new_to_old: Mapping[str, str]) -> None:
        self.inner = inner
        self.old = dict(new_to_old)
        new_of = {old: new for new, old in self.old.items()}
        self.aliases = {k: new_of.get(v, v) for k, v in inner.aliases.items()}

    def keys(self) -> list[str]:
        return list(self.old)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.inner.shape(self.old[key])

    def read(self, key: str, lo: int, dest: torch.Tensor) -> None:
        self.inner.read(self.old[key], lo, dest)

    def extra_state(self) -> dict[str, Any]:
        inner = self.inner.extra_state()
        return {new: inner[old] for new, old in self.old.items() if old in inner}

    def close(self) -> None:
        self.inner.close()


def hf_weights_file(directory: Path) -> Path | None:
    """The weights file of a Hugging Face directory, in the order transformers' ``from_pretrained``
    looks for them: ``model.safetensors``, then ``model.safetensors.index.json``; None if neither.
    A directory holding both (transformers' ``save_pretrained`` leaves a single file behind when it
    saves shards over it) loads what transformers loads, with a warning (probe 35C: zero3 took the
    index, so the same directory loaded other weights under zero3 than under transformers)."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        if index.is_file():
            logger.warning("zero3: %s holds both model.safetensors and model.safetensors.index.json; loading "
                           "model.safetensors, as transformers' from_pretrained does (remove the stale one)", directory)
        return single
    return index if index.is_file() else None


def hf_bin_weights(directory: Path) -> list[str]:
    """The ``.bin`` weight files of a Hugging Face directory (``pytorch_model.bin``, its sharded
    ``pytorch_model.bin.index.json``), which its safetensors readers do not read: named in their errors."""
    return [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (directory / n).is_file()]


def open_source(state_dict_or_path: Any) -> _Source:
    """An open source (returned as is); a mapping; a ``.safetensors`` file; a ``*.safetensors.index.json``
    (sharded) or a directory with ``model.safetensors`` / ``model.safetensors.index.json``; or a
    ``.pt``/``.pth``/``.bin`` file (``torch.load(mmap=True, weights_only=True)``: only the touched pages
    are read)."""
    if isinstance(state_dict_or_path, _Source):
        return state_dict_or_path
    if isinstance(state_dict_or_path, Mapping):
        return _DictSource(state_dict_or_path)
    if not isinstance(state_dict_or_path, (str, os.PathLike)):
        raise TypeError(f"expected a state dict or a path, got {type(state_dict_or_path).__name__}")
    path = Path(state_dict_or_path)
    if path.is_dir():
        found = hf_weights_file(path)
        if found is None:
            bins = hf_bin_weights(path)
            if bins:
                raise CheckpointError(
                    f"{path}: holds {' and '.join(bins)}, no model.safetensors or model.safetensors.index.json; a "
                    "directory is read through its safetensors files: pass the .bin file itself (path/"
                    "pytorch_model.bin; a sharded one shard file at a time, with strict=False)")
            raise CheckpointNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json in it")
        path = found
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: file does not exist")
    if path.name.endswith(".index.json") and not path.name.endswith(".safetensors.index.json"):
        raise CheckpointError(  # its shards went to the safetensors header reader: "truncated" (probe 28E)
            f"{path}: an index of {path.name[:-len('.index.json')]} shards, not of safetensors files; zero3 reads a "
            "sharded checkpoint as safetensors only: write it with safe_serialization=True "
            "(convert_zero_checkpoint_to_fp32_state_dict), or give one .bin/.pt file at a time")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_bytes())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorruptError(f"{path}: not a safetensors index ({exc!r})") from None
        return _SafetensorsSource({k: path.parent / f for k, f in weight_map.items()})
    if path.suffix == ".safetensors":
        header = read_safetensors_header(path)
        return _SafetensorsSource({k: path for k in header.entries})
    if path.suffix in (".pt", ".pth", ".bin"):
        mapped = zipfile.is_zipfile(path)  # torch's legacy format (before 1.6; still written) cannot be mapped
        try:                               # and is read whole (probe 35C: it was called corrupt)
            sd = torch.load(path, map_location="cpu", mmap=mapped, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - reported with the file name
            raise CheckpointCorruptError(f"{path}: cannot be read by torch.load ({exc})") from None
        if not isinstance(sd, Mapping):
            raise CheckpointCorruptError(f"{path}: holds a {type(sd).__name__}, not a state dict")
        return _DictSource(sd)
    raise ValueError(f"{path}: unknown format {path.suffix!r}; use .safetensors, an index .json, or .pt")


# -- loading ----------------------------------------------------------------------------------------
def _target(model_or_engine: Any) -> tuple[nn.Module, RuntimeContext | None]:
    """(model, the engine's context or None when the model was only built under Init)."""
    ctx = getattr(model_or_engine, "context", None)
    if isinstance(ctx, RuntimeContext) and ctx.module is not None:
        return ctx.module, ctx
    if isinstance(model_or_engine, nn.Module):
        return model_or_engine, model_or_engine.__dict__.get("_zero3_context")
    raise TypeError(f"expected an nn.Module or a zero3 Engine, got {type(model_or_engine).__name__}")


def load_state_dict(model_or_engine: Any, state_dict_or_path: Any, strict: bool = True) -> LoadResult:
    """Load full tensors into a (partitioned) model, each rank copying only its slice of each.

    A collective when the model is partitioned over several ranks (call it on every rank). Tied
    parameters count as present when any of their names is; every name present is checked, and names
    of one tied parameter holding different values are refused (torch would keep the last one's).
    Buffers and parameters that are not
    partitioned are copied whole. A module whose class overrides ``set_extra_state`` is given the
    source's value under its ``<prefix>._extra_state`` key; with ``strict``, that key is missing
    when the source lacks it, and an extra-state key of no such module is unexpected (torch's rules).

    Args:
        model_or_engine: a model built under `zero3.Init` (or passed to `zero3.initialize`), or the engine.
        state_dict_or_path: a ``{name: tensor}`` mapping, a ``.safetensors`` file, a sharded
            ``*.safetensors.index.json`` (or a directory with one), or a ``.pt`` file.
        strict: missing or unexpected keys are an error (as in ``nn.Module.load_state_dict``).

    Returns:
        `LoadResult` with the missing and unexpected keys.

    Raises:
        CheckpointMismatchError (``ValueError``): shape mismatches, names of one tied parameter with
            different values, or missing/unexpected keys with ``strict``; all listed, nothing changed.
        CheckpointNotFoundError / CheckpointCorruptError: the file cannot be read.
        ZeroStateError: called while partitioned parameters are gathered.
    """
    module, engine = _target(model_or_engine)
    params = [p for p in module.parameters() if isinstance(p, ZeroParameter)]
    owner = engine if engine is not None else (params[0]._zero.ctx if params else None)
    source: _Source | None = None
    result: LoadResult | None = None
    plan: list[tuple[str, torch.Tensor | ZeroParameter | nn.Module]] = []
    error: BaseException | None = None
    try:
        if params and hasattr(params[0]._zero.ctx, "require_states"):
            params[0]._zero.ctx.require_states("pretrained.load_state_dict", ("lp_params", "hp_params"))
            params[0]._zero.ctx.coordinator.refresh_persistent(gather=False)  # engine.generation()'s kept copies go
        if not isinstance(state_dict_or_path, _Source):  # zero3.from_pretrained's: transformers' loader runs none
            warn_skipped_hooks(module)
        source = open_source(state_dict_or_path)
        result, plan, nesting = _plan(module, source, strict, compare_tied=True)
        if nesting:  # strict=False: loads nothing (strict raised saying so)
            logger.warning("zero3::pretrained load_state_dict(strict=False) loads nothing: %s", nesting)
    except Exception as exc:  # noqa: BLE001 - agreed across ranks below
        error = exc
    try:
        if owner is not None:
            exchange(owner, None, error, "pretrained.load_state_dict validation")
        elif error is not None:
            raise error
        assert source is not None and result is not None
        with torch.no_grad():
            for key, target in plan:
                if isinstance(target, ZeroParameter):
                    _load_partitioned(source, key, target)
                elif isinstance(target, nn.Module):
                    target.set_extra_state(source.extra_state()[key])
                else:
                    source.read(key, 0, target)
            ctx = engine if engine is not None else (params[0]._zero.ctx if params else None)
            if isinstance(ctx, RuntimeContext) and ctx.module is not None:  # a submodule of a managed model too
                ctx.coordinator.refresh_persistent()  # its persistent parameters kept the old values until a step
    finally:
        if source is not None:
            source.close()
    return result


def match_keys(module: nn.Module, source: _Source) -> LoadResult:
    """The missing and unexpected keys `load_state_dict` would report, without loading anything
    (shape mismatches raise here too; the values of a tied parameter's names are not compared, so
    that it reads nothing and needs no agreement across ranks)."""
    return _plan(module, source, strict=False)[0]


def owned_range(p: torch.Tensor) -> tuple[int, int]:
    """This rank's flat element range of ``p`` (all of it when ``p`` is not partitioned)."""
    if not isinstance(p, ZeroParameter):
        return 0, p.numel()
    start, end = p._zero.shard_range()
    return start, max(min(end, p._zero.numel), start)


def same_values(source: _Source, key: str, other: str, target: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether ``source``'s ``key`` and ``other`` hold the same values on this rank's slice of ``target``
    (`owned_range`), both read in the dtype a load writes them in (the fp32 master's, where ``target``
    has one), ``chunk`` elements at a time. A rank sees only its own slice: the callers agree on the
    outcome across ranks."""
    dtype = target.dtype
    if isinstance(target, ZeroParameter) and target._zero.master is not None:
        dtype = target._zero.master.dtype
    start, end = owned_range(target)
    for lo in range(start, end, chunk):
        n = min(chunk, end - lo)
        a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        source.read(key, lo, a)
        source.read(other, lo, b)
        if not torch.equal(a, b) and not bool(((a == b) | (a.isnan() & b.isnan())).all()):  # NaN alike: equal
            return False
    return True


def _plan(module: nn.Module, source: _Source, strict: bool, compare_tied: bool = False
          ) -> tuple[LoadResult, list[tuple[str, torch.Tensor | ZeroParameter | nn.Module]], str | None]:
    """Match the model's state dict keys to the source; (result, [(source key, target)], what to pass
    instead when nothing matched and a nested entry holds the keys (`_nesting`)) or raise.

    Every name of a tied parameter present in the source is checked (value, shape); with
    ``compare_tied`` their values on this rank's slice are compared too, and names that differ are
    refused (the caller agrees on the outcome across ranks)."""
    available = set(source.keys())
    # Tied parameters: every name of one tensor, in state_dict order.
    names_of: dict[int, list[str]] = {}
    targets: dict[int, Any] = {}
    order: list[int] = []
    for key, value in state_tensors(module).items():  # the parameters themselves, persistent ones included
        if id(value) not in names_of:
            names_of[id(value)] = []
            targets[id(value)] = value
            order.append(id(value))
        names_of[id(value)].append(key)
    plan: list[tuple[str, Any]] = []
    missing: list[str] = []
    used: set[str] = set()
    shape_errors: list[str] = []
    tied_differ: list[str] = []
    gathered: list[str] = []
    for ident in order:
        names = names_of[ident]
        target = targets[ident]
        # a name whose value is not a tensor counts too: it is reported, not skipped
        present = [n for n in names if n in available or source.problem(n) is not None]
        if not present:
            present = list(dict.fromkeys(source.aliases[n] for n in names if source.aliases.get(n) in available))
        if not present:
            missing.extend(names)
            continue
        key = present[0]
        used.update(present)
        shape = tuple(target._zero.shape if isinstance(target, ZeroParameter) else target.shape)
        bad = False
        for name in present:  # every name of a tied parameter: the values under each would be loaded
            why = source.problem(name)  # present with a value that cannot be loaded (or not a tensor at all)
            if why is not None:
                shape_errors.append(f"{name}: {why}")
                bad = True
            elif tuple(source.shape(name)) != shape:
                shape_errors.append(f"{name}: {list(source.shape(name))} in the source, {list(shape)} in the model")
                bad = True
        if bad:
            continue
        if compare_tied:  # torch copies each name in turn, so the last one's values win, silently (probe 38C)
            tied_differ.extend(f"{key} and {other}" for other in present[1:]
                               if not same_values(source, key, other, target))
        if isinstance(target, ZeroParameter):
            z = target._zero
            if z.status is not ParamStatus.NOT_AVAILABLE and not z.persistent:
                gathered.append(names[0])
            plan.append((key, target))
        else:
            plan.append((key, target.detach()))
    extra = source.extra_state()
    settable = extra_state_modules(module, "set_extra_state")
    for key, (_, m) in settable.items():  # torch's rules: a module without set_extra_state takes none
        if key in extra:
            plan.append((key, m))
        else:
            missing.append(key)
    unexpected = [k for k in source.keys() if k not in used and source.aliases.get(k) not in used]
    unexpected += [k for k in extra if k not in settable]
    model_keys = {n for names in names_of.values() for n in names}
    unexpected += [k for k in source.other_keys() if k not in model_keys]  # a nested dict, a list: torch's too
    nesting = _nesting(source, missing) if not plan else None
    if gathered:
        raise ZeroStateError(f"load_state_dict while parameters are gathered ({', '.join(gathered[:5])}); call it "
                             "outside forward/backward and GatheredParameters (after a forward with gradients whose "
                             "backward will not run, a second forward under torch.no_grad() ends that step: the first joins it)")
    problems = [nesting] if strict and nesting else []
    if shape_errors:
        problems.append("shape mismatch: " + "; ".join(shape_errors))
    if tied_differ:
        problems.append(f"the source holds {'; '.join(tied_differ)}, names of one tied parameter of the model, with "
                        "different values (torch's nn.Module.load_state_dict would keep the last name's values; "
                        "zero3 refuses): leave out the name whose values are not to be loaded, or untie the "
                        "parameters in the model")
    if strict and missing:
        problems.append("missing keys: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected))
    if problems:
        raise CheckpointMismatchError("load_state_dict: " + ". ".join(problems) + ". Nothing was loaded"
                                      + ("; pass strict=False to skip missing and unexpected keys" if strict and
                                         (missing or unexpected) and not nesting else ""))
    return LoadResult(missing, unexpected), plan, nesting


def _nesting(source: _Source, missing: list[str]) -> str | None:
    """What to pass instead when none of the model's keys matched and a nested mapping holds them."""
    holder = source.holder_of(missing) if missing else None
    if holder is None:
        return None
    return (f"the model's keys are under the source's {holder[0]!r} entry ({holder[1]} of {len(missing)} there): "
            f"pass sd[{holder[0]!r}], that entry of the dict (torch.load a file first)")


def _load_partitioned(source: _Source, key: str, p: ZeroParameter) -> None:
    z = p._zero
    start, end = z.shard_range()
    n = max(end - start, 0)
    with z.ctx.resident([p], write=True):  # written back when the shard or master lives on NVMe
        dest = z.train_tensor
        dest[n:].zero_()
        source.read(key, start, dest[:n])
        if dest is not z.shard:
            z.shard.copy_(dest)
    if z.status is not ParamStatus.NOT_AVAILABLE:  # persistent, gathered: refreshed by the caller
        assert z.persistent, f"{z.name} is gathered while loading"


__all__ = ["LoadResult", "RenamedSource", "load_state_dict", "match_keys", "open_source", "owned_range", "same_values"]
