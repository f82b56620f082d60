"""Reading a sharded checkpoint at any world size: its metadata (checked on opening, against the
checksum the rank files record: integrity.py [Note: metadata checksum]), its files (sizes, sha256), and any element range of any saved tensor, straight into the caller's tensor.

Needs no model, engine or process group: loading into an engine (load.py) and the offline
consolidation (consolidate.py) read through it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .format import (
    FORMAT_NAME,
    READABLE_VERSIONS,
    LATEST_FILE,
    METADATA_FILE,
    MODEL_PARALLEL_FILE,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    ParamMeta,
    check_tag,
    model_parallel_dir,
)
from .foreign import check_not_foreign, foreign_below, weight_files
from .integrity import STAMP_KEY, check_stamp, file_sha256, metadata_digest
from .safetensors import SafetensorsHeader, dtype_name, parse_dtype, read_safetensors_header, read_tensor_range

logger = logging.getLogger(__name__)


class CheckpointReader:
    """One checkpoint tag: its metadata, and reads of any element range of any saved tensor.

    Opening it reads and checks only the metadata; `check_files` checks the rank files. Reads open each
    file once and read just the requested bytes. A checkpoint saved with model parallelism holds one
    such set per model-parallel rank: ``model_parallel_rank`` says which one to read.

    Raises:
        CheckpointNotFoundError / CheckpointCorruptError / CheckpointVersionError: see the messages.
        CheckpointMismatchError: ``model_parallel_rank`` is missing for a model-parallel checkpoint, out
            of its range, or given for a checkpoint saved without model parallelism.
    """

    def __init__(self, ckpt_dir: str | os.PathLike[str], tag: str | None = None,
                 model_parallel_rank: int | None = None) -> None:
        if tag is not None:
            tag = check_tag(tag)  # a name of a directory here (an int taken as its digits): not a path or '..'
        self.root = Path(ckpt_dir)
        if self.root.exists() and not self.root.is_dir():  # probe 38C: a torch.save file was "does not exist"
            raise CheckpointNotFoundError(
                f"{self.root}: is a file, not a checkpoint directory; load_checkpoint and zero3.consolidate read the "
                "directory save_checkpoint wrote. A state-dict file (.pt, .bin, .safetensors) loads with "
                "zero3.pretrained.load_state_dict(engine, path)")
        if not self.root.is_dir():
            raise CheckpointNotFoundError(f"{self.root}: checkpoint directory does not exist")
        check_not_foreign(self.root, tag)  # torch DCP, DeepSpeed: named, not "metadata.json: missing"
        if tag is None:
            latest = self.root / LATEST_FILE
            if not latest.is_file():
                raise CheckpointNotFoundError(f"{latest}: missing, so the newest checkpoint is unknown; "
                                              f"{self._pass_a_tag()}")
            try:  # written by a save, or by hand: a plain tag, not empty or a path
                tag = check_tag(latest.read_text().strip())
            except ValueError as exc:
                raise CheckpointNotFoundError(f"{latest}: names no checkpoint ({exc}); {self._pass_a_tag()}") from None
        self.tag = tag
        self.path = self.root / tag
        old = self.root / f".{tag}.old"
        if not self.path.is_dir() and ((old / METADATA_FILE).is_file() or (old / MODEL_PARALLEL_FILE).is_file()):
            logger.warning("zero3::checkpoint %s is missing; using %s (a save of the same tag was interrupted)",
                           self.path, old)
            self.path = old
        self.model_parallel_world_size = self._model_parallel(model_parallel_rank)
        if self.model_parallel_world_size > 1:
            assert model_parallel_rank is not None
            self.path = self.path / model_parallel_dir(model_parallel_rank)
        self.metadata_path = self.path / METADATA_FILE
        if not self.metadata_path.is_file():
            raise CheckpointNotFoundError(f"{self.metadata_path}: missing (no checkpoint {tag!r} in {self.root})")
        raw = self.metadata_path.read_bytes()
        try:
            meta = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{self.metadata_path}: not valid JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{self.metadata_path}: not zero3 checkpoint metadata "
                                         f"(format {meta.get('format') if isinstance(meta, dict) else None!r})")
        version = meta.get("format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointVersionError(
                f"{self.metadata_path}: checkpoint format version {version!r} is not supported; this zero3 reads "
                f"versions {', '.join(map(str, READABLE_VERSIONS))}. Use the zero3 release that wrote it (or a newer "
                "one) to consolidate it")
        self.version = int(version)
        self.metadata_sha256 = metadata_digest(raw)
        self._check_first_stamp(meta.get("files"))
        try:
            self.meta = meta
            self.world_size = int(meta["world_size"])
            self.files = [self.path / f["file"] for f in meta["files"]]
            self.params = {pm["name"]: ParamMeta(
                name=pm["name"], shape=tuple(pm["shape"]), dtype=parse_dtype(pm["dtype"]),
                master_dtype=parse_dtype(pm["master_dtype"]), numel=int(pm["numel"]),
                aliases=tuple(pm["aliases"]), ranges=tuple((int(a), int(b)) for a, b in pm["ranges"]),
                state=dict(pm["optimizer_state"]), requires_grad=pm.get("requires_grad")) for pm in meta["params"]}
            self.buffers = {k: (tuple(v["shape"]), parse_dtype(v["dtype"])) for k, v in meta["buffers"].items()}
            self.layout = [tuple(row) for row in meta["state_dict"]]
            for pm in self.params.values():
                if len(pm.ranges) != len(self.files):
                    raise ValueError(f"{pm.name} has {len(pm.ranges)} ranges for {len(self.files)} files")
                covered = sum(b - a for a, b in pm.ranges)
                if covered != pm.numel:
                    raise ValueError(f"the ranges of {pm.name} cover {covered} of {pm.numel} elements")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{self.metadata_path}: malformed metadata ({exc!r})") from None
        if len(self.files) != self.world_size:
            raise CheckpointCorruptError(f"{self.metadata_path}: lists {len(self.files)} files for world size "
                                         f"{self.world_size}")
        self._headers: dict[int, SafetensorsHeader] = {}
        self._handles: dict[int, BinaryIO] = {}

    def _pass_a_tag(self) -> str:
        """What to do without a usable ``latest``, with the tags under the root that hold a checkpoint."""
        tags = sorted(d.name for d in self.root.iterdir() if (d / METADATA_FILE).is_file())
        weights = [] if tags else weight_files(self.root)
        return (f"pass a tag (tag=, or --tag on the command line; tags with metadata here: {tags or 'none'})"
                + ("" if tags else foreign_below(self.root))
                + (f"; it holds weight files ({', '.join(weights[:4])}), not a zero3 checkpoint: a state dict file "
                   "loads with zero3.pretrained.load_state_dict(engine, path)" if weights else ""))

    def _check_first_stamp(self, files: Any) -> None:
        """Check metadata.json against the checksum in its first rank file (the first of the directory
        when the metadata lists none), so every reader of the metadata checks it before using any
        of it; `header` checks every other file it opens."""
        try:
            listed = [self.path / f["file"] for f in files]
        except (KeyError, TypeError):
            listed = []
        first = next((f for f in listed if f.is_file()), None) or min(self.path.glob("rank_*-of-*.safetensors"),
                                                                          default=None)
        if first is None:
            return  # `check_files` reports the missing files
        header = read_safetensors_header(first)
        check_stamp(first, header.metadata.get(STAMP_KEY), self.metadata_sha256, self.metadata_path, self.version)
        if header.metadata.get(STAMP_KEY) is None:
            logger.warning("zero3::checkpoint %s was saved by a zero3 without the metadata checksum (format version "
                           "1): metadata.json is not verified; save it again to add one", self.path)

    def _model_parallel(self, rank: int | None) -> int:
        """The model-parallel size the checkpoint was saved with (1: without), checked against ``rank``."""
        path = self.path / MODEL_PARALLEL_FILE
        if not path.is_file():
            if rank is not None:
                raise CheckpointMismatchError(
                    f"{self.path}: saved without model parallelism (no {MODEL_PARALLEL_FILE}), but model-parallel "
                    f"rank {rank} was asked for; load it into an engine without an mpu (or a model-parallel group "
                    "of one rank)")
            return 1
        try:
            world = int(json.loads(path.read_bytes())["model_parallel_world_size"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{path}: malformed ({exc!r})") from None
        if rank is None:
            raise CheckpointMismatchError(
                f"{self.path}: saved by {world} model-parallel ranks, one directory each; load it with an mpu of "
                f"model-parallel size {world}, or pass model_parallel_rank= (python -m zero3.consolidate "
                "--model-parallel-rank R) to read one rank's slices")
        if not 0 <= rank < world:
            raise CheckpointMismatchError(f"{self.path}: saved by {world} model-parallel ranks; model-parallel rank "
                                          f"{rank} is not one of them")
        return world

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()

    def check_files(self, hash_files: Iterable[int] = ()) -> None:
        """Every rank file exists with the recorded size; files in ``hash_files`` also match their sha256."""
        for f, path in zip(self.meta["files"], self.files):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"{path}: rank file missing (checkpoint {self.tag!r} was saved by {self.world_size} ranks; "
                    "copy every rank_*.safetensors file with metadata.json)") from None
            if size != f["bytes"]:
                raise CheckpointCorruptError(f"{path}: {size} bytes, but the metadata records {f['bytes']} "
                                             "(truncated or overwritten)")
        for j in hash_files:
            self.header(j)  # its stamp: the metadata it belongs to
            expected = self.meta["files"][j]["sha256"]
            digest = file_sha256(self.files[j])
            if digest != expected:
                raise CheckpointCorruptError(f"{self.files[j]}: sha256 {digest[:16]}... does not match the metadata "
                                             f"({expected[:16]}...): the file is corrupted")

    def header(self, j: int) -> SafetensorsHeader:
        if j not in self._headers:
            header = read_safetensors_header(self.files[j])
            check_stamp(self.files[j], header.metadata.get(STAMP_KEY), self.metadata_sha256, self.metadata_path,
                        self.version)
            self._headers[j] = header
        return self._headers[j]

    def check_entry(self, j: int, key: str, numel: int, dtype: torch.dtype) -> None:
        entry = self.header(j).entries.get(key)
        if entry is None or entry.numel != numel or entry.dtype != dtype:
            found = "missing" if entry is None else f"{entry.numel} x {dtype_name(entry.dtype)}"
            raise CheckpointCorruptError(f"{self.files[j]}: tensor {key!r} should hold {numel} x {dtype_name(dtype)} "
                                         f"elements, found {found}: the file does not belong to this metadata")

    def read(self, j: int, key: str, elem_offset: int, dest: torch.Tensor) -> None:
        fh = self._handles.get(j)
        if fh is None:
            fh = self._handles[j] = open(self.files[j], "rb", buffering=0)  # noqa: SIM115 - closed in close()
        read_tensor_range(fh, self.header(j), key, elem_offset, dest)

    def flat_sources(self, pm: ParamMeta, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """(file, offset in that file's piece, start, end) for each piece of global range [lo, hi)."""
        for j, (a, b) in enumerate(pm.ranges):
            s, e = max(lo, a), min(hi, b)
            if s < e:
                yield j, s - a, s, e

    def read_flat(self, pm: ParamMeta, key: str, lo: int, hi: int, dest: torch.Tensor) -> None:
        """Read global elements [lo, hi) of ``key`` (``param/..`` or a sharded ``optim/..``) into ``dest``."""
        for j, off, s, e in self.flat_sources(pm, lo, hi):
            self.read(j, key, off, dest[s - lo: e - lo])


__all__ = ["CheckpointReader", "ParamMeta"]
