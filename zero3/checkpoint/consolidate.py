"""The full state dict of a sharded checkpoint, offline and streaming (a live engine's: live_state_dict.py).

``python -m zero3.consolidate CKPT_DIR OUT [--tag T] [--dtype bf16|fp16|fp32] [--include-optimizer]``
needs no model code: the checkpoint's metadata lists every tensor, with its shape and the ranges each
rank file holds. Tensors are produced one at a time. Each full tensor is read range by range straight
into its final buffer, written, and freed, so peak memory stays near the largest tensor (1.5x it
with a ``--dtype`` cast), not the model.
- ``.safetensors`` output: the header is computed up front and written first, then each tensor's
  bytes. Tied parameters are written once under their first name; the aliases go in
  ``__metadata__["zero3_aliases"]`` (safetensors cannot store shared tensors). The modules' extra
  state (``<prefix>._extra_state``, any object) is left out, with a warning naming its keys: write a
  ``.pt`` to keep it.
- ``.pt`` output: a zip archive of the kind ``torch.save`` writes (records ``data/N``, then ``data.pkl``),
  written record by record. ``torch.load`` (with ``weights_only=True`` and ``mmap=True`` too) returns a
  plain state dict in which tied names share one tensor, as ``model.state_dict()`` does, with the
  modules' extra state at its place.

With ``--include-optimizer`` the optimizer state is added: in ``.pt`` the file holds ``{"model": ...,
"optimizer": {"state": {name: {key: tensor}}, "param_groups": [...]}}``; in ``.safetensors`` the
extra keys are ``optimizer/<param name>/<key>``, and the param groups and the state that is no tensor
go in ``__metadata__`` (``zero3_optimizer``, ``zero3_optimizer_values``).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import logging
import math
import os
import re
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..optim.precision import DTYPES
from .format import from_json
from .reader import CheckpointReader, ParamMeta
from .safetensors import SafetensorsWriter, dtype_name, parse_dtype

SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
"""The output files `consolidate` writes: safetensors, or torch.save's zip archive."""
Spec = tuple[str, torch.dtype, tuple[int, ...]]
"""(key written, dtype written, shape) of one output tensor."""
Row = tuple[str, str, str]
"""One state_dict key: (key, "param" or "buffer", canonical param name or the key)."""

logger = logging.getLogger(__name__)


_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_shard_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (decimal units TB/GB/MB/KB, as transformers)."""
    bad = ValueError(f"max_shard_size {size!r}: give bytes as an int or a string ending in TB, GB, MB or KB")
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise bad
    if isinstance(size, int):
        if size < 0:
            raise bad
        return size
    text = size.strip()
    unit = text[-2:].upper()
    try:
        value = float(text[:-2].strip()) * _UNITS[unit]
    except (KeyError, ValueError):
        raise bad from None
    if not math.isfinite(value) or value < 0:
        raise bad
    return int(value)


# -- offline: checkpoint directory -> tensors -------------------------------------------------------
def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read_param(reader: CheckpointReader, pm: ParamMeta, key: str, dtype: torch.dtype) -> torch.Tensor:
    full = torch.empty(pm.numel, dtype=dtype)
    reader.read_flat(pm, key, 0, pm.numel, full)
    return full.view(pm.shape)


def check_cast_dtype(dtype: object, what: str) -> None:
    """A dtype to cast floating-point tensors to is None or a floating-point torch.dtype (a string
    failed later as an invalid device; int8 would truncate the weights)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{what} must be a floating-point torch.dtype or None, got {dtype!r}")


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` cast to ``dtype`` if it is floating-point and ``dtype`` is given, else ``t`` itself."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _plan(reader: CheckpointReader, dtype: torch.dtype | None, include_optimizer: bool,
          exclude_frozen: bool = False) -> tuple[list[Row], list[Spec]]:
    """(layout rows [key, kind, source], specs [(written key, dtype, shape)]) for the output; with
    ``exclude_frozen``, without the parameters whose ``requires_grad`` was False at the save (their tied
    names and optimizer state too)."""
    def out_dtype(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    # A "buffer" row naming a parameter: zero3 before 2026-12-03 wrote persistent parameters so (their
    # gathered, low-precision values); their param/ entry holds the masters.
    frozen = _frozen(reader) if exclude_frozen else frozenset()
    layout: list[Row] = [(row[0], "param", row[0]) if row[1] == "buffer" and row[0] in reader.params
                         else (row[0], row[1], row[2]) for row in reader.layout]
    layout = [row for row in layout if row[2] not in frozen]
    specs: list[Spec] = []
    written: set[str] = set()
    for key, kind, src in layout:
        if kind == "param" and src not in written:
            pm = reader.params[src]
            specs.append((src, out_dtype(pm.master_dtype), pm.shape))
            written.add(src)
        elif kind == "buffer":
            shape, bdtype = reader.buffers[src]
            specs.append((key, out_dtype(bdtype), shape))
    if include_optimizer:
        for name, pm in reader.params.items():
            for k, info in pm.state.items() if name not in frozen else ():
                if info["kind"] == "sharded":
                    specs.append((f"optimizer/{name}/{k}", parse_dtype(info["dtype"]), pm.shape))
                elif info["kind"] == "replicated":
                    specs.append((f"optimizer/{name}/{k}", parse_dtype(info["dtype"]), tuple(info["shape"])))
    return layout, specs


def iter_tensors(reader: CheckpointReader, specs: list[Spec]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` for each spec, building one tensor at a time."""
    for key, dtype, _ in specs:
        if key.startswith("optimizer/"):
            name, _, skey = key[len("optimizer/"):].rpartition("/")
            pm = reader.params[name]
            info = pm.state[skey]
            if info["kind"] == "sharded":
                yield key, _read_param(reader, pm, f"optim/{name}/{skey}", dtype)
            else:
                t = torch.empty(tuple(info["shape"]), dtype=dtype)
                reader.read(0, f"optim/{name}/{skey}", 0, t)
                yield key, t
        elif key in reader.params:
            pm = reader.params[key]
            yield key, cast_floating(_read_param(reader, pm, f"param/{key}", pm.master_dtype), dtype)
        else:
            shape, bdtype = reader.buffers[key]
            t = torch.empty(shape, dtype=bdtype)
            reader.read(0, f"buffer/{key}", 0, t)
            yield key, cast_floating(t, dtype)


def consolidate(ckpt_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, tag: str | None = None,
                dtype: torch.dtype | None = None, include_optimizer: bool = False, verify: bool = True,
                model_parallel_rank: int | None = None, exclude_frozen: bool = False) -> Path:
    """Write the full state dict of a sharded checkpoint to ``out`` (``.pt`` or ``.safetensors``).

    The modules' extra state goes into a ``.pt`` output; a ``.safetensors`` one holds only tensors and
    leaves it out, with a warning.

    Args:
        ckpt_dir: the directory given to ``save_checkpoint``.
        out: output file; the suffix picks the format (``.safetensors``, or ``.pt``/``.pth``/``.bin``).
        tag: which checkpoint (default: ``latest``).
        dtype: cast floating-point weights and buffers to this dtype (optimizer state stays as saved).
        include_optimizer: also write the optimizer state (see the module docstring for the layout).
        verify: check every rank file's sha256 first.
        model_parallel_rank: for a checkpoint saved with model parallelism, whose tensor-parallel
            slices to write (one state dict per model-parallel rank, as the model code holds them).
        exclude_frozen: leave out the parameters whose ``requires_grad`` was False at the save.

    Returns:
        The output path.

    Raises:
        CheckpointError subclasses (``ValueError``): a missing, corrupted or unsupported checkpoint.
        ValueError: an unknown output suffix.
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{out}: unknown output format {suffix!r}; use .safetensors or .pt")
    with CheckpointReader(ckpt_dir, tag, model_parallel_rank) as reader:
        reader.check_files(range(reader.world_size) if verify else ())
        layout, specs = _plan(reader, dtype, include_optimizer, exclude_frozen)
        if exclude_frozen and not specs:
            raise ValueError(f"{ckpt_dir}: nothing to write (every parameter excluded)")
        _check_entries(reader, specs)
        out.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".safetensors":
            _write_safetensors(reader, out, layout, specs, include_optimizer, exclude_frozen=exclude_frozen)
        else:
            _write_pt(reader, out, layout, specs, include_optimizer, exclude_frozen=exclude_frozen)
    return out


def load_consolidated(ckpt_dir: str | os.PathLike[str], *, tag: str | None = None, dtype: torch.dtype | None = None,
                      verify: bool = True, model_parallel_rank: int | None = None,
                      exclude_frozen: bool = False) -> dict[str, Any]:
    """The full state dict of a sharded checkpoint in memory, as ``torch.load`` of `consolidate`'s
    ``.pt`` gives it: the fp32 masters of trained parameters (frozen ones in their dtype), buffers, tied
    names sharing one tensor, the modules' extra state at its place. Arguments as `consolidate`'s."""
    check_cast_dtype(dtype, "dtype")
    with CheckpointReader(ckpt_dir, tag, model_parallel_rank) as reader:
        reader.check_files(range(reader.world_size) if verify else ())
        layout, specs = _plan(reader, dtype, False, exclude_frozen)
        _check_entries(reader, specs)
        tensors = dict(iter_tensors(reader, specs))
        return _with_extra_state(reader, [(key, tensors[src if kind == "param" else key]) for key, kind, src in layout])


_PRECEDENCE = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The weight files Hugging Face's ``from_pretrained`` looks for in a directory, first found first taken."""


def consolidate_to_dir(ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, max_shard_size: int,
                       safetensors: bool, tag: str | None = None, dtype: torch.dtype | None = None,
                       verify: bool = True, model_parallel_rank: int | None = None,
                       exclude_frozen: bool = False) -> list[Path]:
    """`consolidate` into ``out_dir`` in Hugging Face's layout: ``model.safetensors`` (or, without
    ``safetensors``, ``pytorch_model.bin``) when the state dict fits ``max_shard_size`` bytes; else
    files ``model-0000k-of-0000n.safetensors`` (``pytorch_model-...bin``), filled in order, a tensor
    larger than the limit alone in its file, and an index (``model.safetensors.index.json``) mapping
    each key to its file. The modules' extra state goes with the first ``.bin`` file. ``exclude_frozen``
    as `consolidate`'s. Returns the files written.

    What is in ``out_dir`` already: a weight file ``from_pretrained`` would take before the new ones
    (``model.safetensors`` beside new ``.bin`` files; review 28Z2 found every weight stale so) is
    refused before anything is written, naming it. The new files are written under staged names and
    put in place only when all are written, so a failure halfway leaves the directory as it was
    (review 28Z4); then this format's index, if the new output has none, and its numbered files the
    new index does not list are removed (as transformers' ``save_pretrained`` removes old shards).
    Nothing else is deleted."""
    out = Path(out_dir)
    stem, suffix = ("model", ".safetensors") if safetensors else ("pytorch_model", ".bin")
    with CheckpointReader(ckpt_dir, tag, model_parallel_rank) as reader:
        reader.check_files(range(reader.world_size) if verify else ())
        layout, specs = _plan(reader, dtype, False, exclude_frozen)
        if not specs:
            raise ValueError(f"{ckpt_dir}: nothing to write (every parameter excluded)")
        _check_entries(reader, specs)
        groups: list[list[Spec]] = []
        size = total = 0
        for spec in specs:
            n = _numel(spec[2]) * torch.empty((), dtype=spec[1]).element_size()
            total += n
            if not groups or (size + n > max_shard_size and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(spec)
            size += n
        names = [f"{stem}{suffix}"] if len(groups) == 1 else \
            [f"{stem}-{i + 1:05d}-of-{len(groups):05d}{suffix}" for i in range(len(groups))]
        index = f"{stem}{suffix}.index.json"
        mine = names[0] if len(groups) == 1 else index
        shadows = [n for n in _PRECEDENCE[:_PRECEDENCE.index(mine)] if (out / n).exists()]
        if shadows:
            raise ValueError(f"{out} holds {', '.join(shadows)}, which Hugging Face's from_pretrained loads before the "
                             f"{mine} this would write: remove it first (zero3 deletes no weight file but this "
                             "format's index and numbered files). Nothing was written")
        out.mkdir(parents=True, exist_ok=True)
        for entry in out.glob(f".{stem}*.zero3-staged*"):  # left by a run that was killed
            entry.unlink()
        final = names + ([index] if len(groups) > 1 else [])
        staged = {n: out / f".{n}.zero3-staged" for n in final}
        try:
            weight_map: dict[str, str] = {}
            for i, (name, group) in enumerate(zip(names, groups)):
                keys = {spec[0] for spec in group}
                rows = [row for row in layout if (row[2] if row[1] == "param" else row[0]) in keys]
                weight_map.update({row[0]: name for row in rows
                                   if not safetensors or row[1] != "param" or row[0] == row[2]})
                if not safetensors and i == 0:
                    weight_map.update({key: name for key in _extra_state(reader)})
                if safetensors:
                    _write_safetensors(reader, staged[name], rows, group, False, warn=i == 0, shown=out / name)
                else:
                    _write_pt(reader, staged[name], rows, group, False, extra=i == 0)
            if len(groups) > 1:
                staged[index].write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2))
        except BaseException:
            for path in staged.values():
                path.unlink(missing_ok=True)
            raise
    try:
        for n in final:  # the index last: until it is in place, the old one describes the old files
            os.replace(staged[n], out / n)
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    numbered = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(suffix)}")
    for entry in out.iterdir():
        stale = (numbered.fullmatch(entry.name) and entry.name not in names) or (entry.name == index and index not in final)
        if stale and entry.is_file():
            entry.unlink()
    return [out / n for n in final]


def _frozen(reader: CheckpointReader) -> frozenset[str]:
    """The parameters whose ``requires_grad`` was False when the checkpoint was saved; one saved before
    zero3 recorded it (2026-12-06) cannot tell: refused."""
    if any(pm.requires_grad is None for pm in reader.params.values()):
        raise ValueError(f"{reader.path} (tag {reader.tag!r}) was saved before zero3 recorded which parameters are "
                         "frozen; leave exclude_frozen_parameters False, or load it and save it again")
    return frozenset(name for name, pm in reader.params.items() if not pm.requires_grad)


def _check_entries(reader: CheckpointReader, specs: list[Spec]) -> None:
    """Every piece the output needs is in its rank file's header, with the recorded size and dtype."""
    for key, _, _ in specs:
        if key.startswith("optimizer/"):
            name, _, skey = key[len("optimizer/"):].rpartition("/")
            pm = reader.params[name]
            info = pm.state[skey]
            if info["kind"] == "sharded":
                for j, _, s, e in reader.flat_sources(pm, 0, pm.numel):
                    reader.check_entry(j, f"optim/{name}/{skey}", e - s, parse_dtype(info["dtype"]))
            else:
                reader.check_entry(0, f"optim/{name}/{skey}", _numel(tuple(info["shape"])), parse_dtype(info["dtype"]))
        elif key in reader.params:
            pm = reader.params[key]
            for j, _, s, e in reader.flat_sources(pm, 0, pm.numel):
                reader.check_entry(j, f"param/{key}", e - s, pm.master_dtype)
        else:
            shape, bdtype = reader.buffers[key]
            reader.check_entry(0, f"buffer/{key}", _numel(shape), bdtype)


def _groups(reader: CheckpointReader, skip: frozenset[str] = frozenset()) -> list[dict[str, Any]] | None:
    """The optimizer's param groups (parameters by name), without the names in ``skip``."""
    opt = reader.meta.get("optimizer")
    if opt is None:
        return None
    return _without([from_json(g) for g in opt["param_groups"]], skip)


def _without(groups: list[dict[str, Any]], skip: frozenset[str]) -> list[dict[str, Any]]:
    return [{**g, "params": [n for n in g["params"] if n not in skip]} for g in groups] if skip else groups


def _left_out(reader: CheckpointReader, exclude_frozen: bool) -> frozenset[str]:
    """The parameters whose optimizer state stays out too, with ``exclude_frozen`` (probe 35C: an excluded
    parameter's state went out, every tensor None, and its name stayed in the groups)."""
    return _frozen(reader) if exclude_frozen else frozenset()


def _extra_state(reader: CheckpointReader) -> dict[str, dict[str, Any]]:
    """The saved modules' extra state: ``{key: {"after": rows of the layout before it, "value": encoded}}``."""
    return reader.meta.get("extra_state") or {}  # none before 2026-12-05


def _with_extra_state(reader: CheckpointReader, entries: list[tuple[str, Any]], extra: bool = True) -> dict[str, Any]:
    """``entries`` (one per layout row) with the modules' extra state at their places in ``state_dict()`` order."""
    rows = [((n, 1), key, value) for n, (key, value) in enumerate(entries)]
    rows += [((e["after"], 0), key, from_json(e["value"])) for key, e in _extra_state(reader).items() if extra]
    return {key: value for _, key, value in sorted(rows, key=lambda row: row[0])}  # stable: saved order kept


def _write_safetensors(reader: CheckpointReader, out: Path, layout: list[Row], specs: list[Spec],
                       include_optimizer: bool, warn: bool = True, exclude_frozen: bool = False,
                       shown: Path | None = None) -> None:
    """Write ``out``; ``shown``: the name the file will have, said in the warning (``out`` is a staged
    temporary file renamed to it afterwards)."""
    extra = _extra_state(reader)
    if extra and warn:
        logger.warning("zero3::consolidate %s leaves out the extra state of %s: safetensors holds only tensors; "
                       "write a .pt file to keep it", shown or out, ", ".join(extra))
    aliases = {key: src for key, kind, src in layout if kind == "param" and key != src}
    meta = {"format": "pt", "zero3_tag": reader.tag, "zero3_global_steps": str(reader.meta["global_steps"]),
            "zero3_aliases": json.dumps(aliases)}
    if include_optimizer:
        skip = _left_out(reader, exclude_frozen)
        opt = reader.meta.get("optimizer")
        if opt is not None:
            opt = {**opt, "param_groups": _without(opt["param_groups"], skip)}
        meta["zero3_optimizer"] = json.dumps(opt)
        # state that is no tensor (a step count an optimizer keeps as a number), encoded as in the checkpoint's
        # metadata: it was left out without a word (probe 35C)
        values = {name: {k: info.get("value") for k, info in pm.state.items() if info["kind"] == "value"}
                  for name, pm in reader.params.items() if name not in skip}
        meta["zero3_optimizer_values"] = json.dumps({name: v for name, v in values.items() if v})
    writer = SafetensorsWriter(out, specs, meta, checksum=False)
    try:
        for key, t in iter_tensors(reader, specs):
            writer.write(key, t)
            del t
    except BaseException:
        writer.abort()
        raise
    writer.close()


# -- streaming .pt ------------------------------------------------------------------------------------
def _storage_type(dtype: torch.dtype) -> str | None:
    """The storage class ``torch.save`` pickles a ``dtype`` tensor's storage as; None for the dtypes it
    saves through an untyped storage and the dtype (float8, uint16/32/64: ``_rebuild_tensor_v3``)."""
    return torch.storage._dtype_to_storage_type_map().get(dtype)


class _Stored:
    """A tensor already written to the archive as record ``data/<key>``; pickled as a reference to it."""

    __slots__ = ("dtype", "key", "shape")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.key, self.dtype, self.shape = key, dtype, shape


class _StorageRef:
    __slots__ = ("stored",)

    def __init__(self, stored: _Stored) -> None:
        self.stored = stored


class PtWriter:
    """Writes a ``torch.save``-compatible archive one tensor at a time.

    `add` writes a tensor's bytes as a record at once and returns a placeholder; `finish` pickles the
    object (placeholders in it become tensors on load) and closes the archive, renaming it into place.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self._zip: Any = torch._C.PyTorchFileWriter(str(self.tmp))
        self._count = 0

    def add(self, tensor: torch.Tensor) -> _Stored:
        t = tensor.detach().to("cpu").contiguous()
        if _storage_type(t.dtype) is None and t.dtype not in torch.storage._new_dtypes():
            raise ValueError(f"cannot write dtype {dtype_name(t.dtype)} to a .pt file")  # a quantized dtype
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        key = str(self._count)
        self._count += 1
        self._zip.write_record(f"data/{key}", t.untyped_storage(), t.numel() * t.element_size())  # no copy
        return _Stored(key, t.dtype, tuple(t.shape))

    def finish(self, obj: Any) -> None:
        writer = self

        class _Pickler(pickle.Pickler):
            def persistent_id(self, o: Any) -> Any:
                if isinstance(o, _StorageRef):
                    s = o.stored
                    typed = _storage_type(s.dtype)
                    if typed is None:  # as torch.save: an untyped storage of the bytes (probe 35C: refused)
                        return ("storage", torch.UntypedStorage, s.key, "cpu", _numel(s.shape) * s.dtype.itemsize)
                    return ("storage", getattr(torch, typed), s.key, "cpu", _numel(s.shape))
                return None

            def reducer_override(self, o: Any) -> Any:
                if isinstance(o, torch.Tensor):
                    o = writer.add(o)
                if isinstance(o, _Stored):
                    stride, acc = [], 1
                    for d in reversed(o.shape):
                        stride.append(acc)
                        acc *= d
                    args = (_StorageRef(o), 0, o.shape, tuple(reversed(stride)), False, collections.OrderedDict())
                    if _storage_type(o.dtype) is None:
                        return torch._utils._rebuild_tensor_v3, (*args, o.dtype)
                    return torch._utils._rebuild_tensor_v2, args
                return NotImplemented

        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        data = buf.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", b"1", 1)
        self._zip.write_record(".storage_alignment", b"64", 2)
        self._zip.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
        self._zip.write_end_of_file()
        del self._zip
        with open(self.tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._zip = None
        self.tmp.unlink(missing_ok=True)


def _write_pt(reader: CheckpointReader, out: Path, layout: list[Row], specs: list[Spec], include_optimizer: bool,
              extra: bool = True, exclude_frozen: bool = False) -> None:
    writer = PtWriter(out)
    stored: dict[str, _Stored] = {}
    try:
        for key, t in iter_tensors(reader, specs):
            stored[key] = writer.add(t)
            del t
        model = _with_extra_state(reader, [(key, stored[src if kind == "param" else key])
                                           for key, kind, src in layout], extra)
        obj: Any = model
        if include_optimizer:
            state: dict[str, dict[str, Any]] = {}
            skip = _left_out(reader, exclude_frozen)
            for name, pm in reader.params.items():
                for k, info in pm.state.items() if name not in skip else ():
                    value = stored.get(f"optimizer/{name}/{k}")
                    state.setdefault(name, {})[k] = value if value is not None else from_json(info.get("value"))
            obj = {"model": model, "optimizer": {"state": state, "param_groups": _groups(reader, skip)}}
        writer.finish(obj)
    except BaseException:
        writer.abort()
        raise


# -- CLI ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero3.consolidate",
        description="Write the full state dict of a zero3 sharded checkpoint, streaming one tensor at a time.")
    parser.add_argument("ckpt_dir", help="directory given to engine.save_checkpoint")
    parser.add_argument("out", help="output file: .safetensors or .pt")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating-point weights")
    parser.add_argument("--include-optimizer", action="store_true", help="also write the optimizer state")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the rank files")
    parser.add_argument("--model-parallel-rank", type=int, default=None,
                        help="checkpoint saved with model parallelism: write this model-parallel rank's slices")
    args = parser.parse_args(argv)
    path = consolidate(args.ckpt_dir, args.out, tag=args.tag, dtype=DTYPES.get(args.dtype) if args.dtype else None,
                       include_optimizer=args.include_optimizer, verify=not args.no_verify,
                       model_parallel_rank=args.model_parallel_rank)
    sys.stdout.write(f"wrote {path} ({path.stat().st_size} bytes)\n")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``python -m zero3.consolidate``: `main`, with a checkpoint's or an argument's error (a missing
    or corrupt file, a bad ``latest``, an unknown output format) printed as one line, exit status 1,
    where a traceback buried it."""
    try:
        return main(argv)
    except (ValueError, OSError) as exc:  # zero3's checkpoint and config errors are ValueErrors
        sys.stderr.write(f"python -m zero3.consolidate: error: {exc}\n")
        return 1


if __name__ == "__main__":  # python -m zero3.checkpoint.consolidate, as python -m zero3.consolidate
    sys.exit(cli())
