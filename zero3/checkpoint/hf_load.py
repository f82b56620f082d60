"""`zero3.from_pretrained`: a Hugging Face ``save_pretrained`` directory, streamed into a partitioned model.

transformers' own ``from_pretrained`` builds the whole model on every process and memory-maps every
file; under `zero3.Init` it still registers each loaded weight whole on every rank (docs/huggingface.md).
Here each rank builds the model under `zero3.Init` without running the random initialisation
(transformers' ``no_init_weights``: the values are overwritten anyway) and then reads, through
`zero3.pretrained`, only the byte ranges of its own slices from the ``*.safetensors`` files. A rank so
holds its shards, one module's uninitialised (untouched) full parameters while building, and one
slice of one tensor in the file's dtype while converting.

What transformers does around the copy is done by transformers' own code, so it behaves the same:
the config and the ``dtype`` (``"auto"`` by default: the config's, else the checkpoint's), key
renamings and the base-model prefix, ``_keys_to_ignore_on_load_*``, ``_init_weights`` on the missing
keys (with the same RNG draws), tying, the generation config, and the load report it logs.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import pretrained
from .exchange import exchange
from .format import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError
from ..errors import ZeroConfigError
from ..partition.param import ZeroParameter
from ..runtime.gathered import GatheredParameters
from ..runtime.init import Init

logger = logging.getLogger(__name__)

_UNSUPPORTED = ("device_map", "quantization_config", "tp_plan", "tp_size", "distributed_config", "gguf_file",
                "state_dict", "adapter_kwargs", "use_kernels", "key_mapping")


def from_pretrained(cls_or_auto: Any, path: str | Path, *, config: Any = None, torch_dtype: Any = None,
                    dtype: Any = None, zero_config: Any = None, group: Any = None, strict: bool = False,
                    ignore_mismatched_sizes: bool = False, output_loading_info: bool = False,
                    **hf_kwargs: Any) -> Any:
    """Load a ``save_pretrained`` directory into a model partitioned across the ranks of ``group``.

    A collective: call it on every rank. Each rank reads only its own slice of every tensor (plus
    whole buffers), so no rank holds the full model; peak memory is this rank's shards plus one
    module's parameters while building (allocated, never written) and one slice while converting.

    Args:
        cls_or_auto: a model class (``LlamaForCausalLM``) or an Auto class (``AutoModelForCausalLM``).
        path: a local directory with ``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` (download hub models first, e.g. ``snapshot_download``).
        config: a ``PreTrainedConfig`` (copied) or a path to one; default: ``path``'s.
        torch_dtype, dtype: the parameters' dtype, as in transformers (``dtype`` wins): a
            ``torch.dtype``, its name, or ``"auto"`` (the default: the config's ``dtype``, else the
            checkpoint's). A ``bf16``/``fp16`` section in ``zero_config`` makes the shards that dtype.
        zero_config: the zero3 config `zero3.Init` builds with (the one later given to `zero3.initialize`).
        group: the process group to partition over (default: as `zero3.Init`).
        strict: missing or unexpected keys (after the model's ``_keys_to_ignore_on_load_*``) raise
            `CheckpointMismatchError` before anything is read.
        ignore_mismatched_sizes: as in transformers: tensors whose shape differs from the model's are
            skipped (and initialised like missing ones) and reported as mismatched, instead of raising.
        output_loading_info: also return transformers' loading-info dict (missing, unexpected,
            mismatched keys and error messages).
        hf_kwargs: passed to the config (``attn_implementation`` and config attributes, as in
            transformers); the rest to the model's ``__init__``.

    Raises:
        CheckpointNotFoundError: no safetensors weights in ``path``.
        CheckpointError: ``path`` holds ``.bin`` weights only (``pytorch_model.bin``, its index), which
            this loader does not read; the message names the `zero3.pretrained.load_state_dict` route.
        CheckpointMismatchError: shape mismatches without ``ignore_mismatched_sizes`` (transformers raises
            too), or missing/unexpected keys with ``strict``.
        ZeroConfigError: a transformers loading option zero3 does not support here, or a model
            whose weights need a conversion other than renaming.
    """
    import transformers  # an optional extra: imported only when used
    from transformers import modeling_utils

    for name in _UNSUPPORTED:
        if hf_kwargs.get(name):
            raise ZeroConfigError(f"zero3.from_pretrained does not support {name}=...; it loads a local safetensors "
                                  "directory into a partitioned model")
        hf_kwargs.pop(name, None)
    path = Path(path)
    files, sharded_metadata = _checkpoint_files(path)
    model_cls, config, model_kwargs = _resolve_config(transformers, cls_or_auto, path, config, hf_kwargs)
    wanted = dtype if dtype is not None else (torch_dtype if torch_dtype is not None else "auto")
    config, dtype = modeling_utils._get_dtype(wanted, [str(f) for f in files], config, sharded_metadata, None,
                                              True, None)
    config.name_or_path = str(path)
    config = copy.deepcopy(config)

    model = _build(transformers, model_cls, config, model_kwargs, dtype, zero_config, group)
    if model._get_dtype_plan(dtype):
        raise ZeroConfigError(f"{model_cls.__name__} keeps modules in fp32 under dtype={dtype} "
                              "(_keep_in_fp32_modules); zero3.from_pretrained does not support that")
    source = _renamed_source(transformers, model, pretrained.open_source(path))
    try:
        mismatched: set = set()
        if ignore_mismatched_sizes:
            source, mismatched = _drop_mismatched(model, source)
        _refuse_differing_tied_pair(model, source)
        info = _loading_info(modeling_utils, model, pretrained.match_keys(model, source), mismatched)
        if strict and (info.missing_keys or info.unexpected_keys):
            raise CheckpointMismatchError(f"zero3.from_pretrained({path}): missing keys {sorted(info.missing_keys)}, "
                                          f"unexpected keys {sorted(info.unexpected_keys)}; nothing was loaded")
    except BaseException:
        source.close()
        raise
    loaded = pretrained.load_state_dict(model, source, strict=False)  # closes the source
    _initialize_missing(model, set(loaded.missing_keys))
    modeling_utils.log_state_dict_report(model=model, pretrained_model_name_or_path=str(path),
                                         ignore_mismatched_sizes=ignore_mismatched_sizes, loading_info=info,
                                         logger=modeling_utils.logger)
    model.eval()
    if model.can_generate() and hasattr(model, "adjust_generation_fn"):
        model.adjust_generation_fn(None, False, None, str(path), cache_dir=None, force_download=False, proxies=None,
                                   local_files_only=True, token=None, revision=None, subfolder="",
                                   trust_remote_code=None)
    if output_loading_info:
        return model, info.to_dict()
    return model


def _checkpoint_files(path: Path) -> tuple[list[Path], dict | None]:
    """The safetensors files of ``path`` and the index's metadata (None for one file)."""
    found = pretrained.hf_weights_file(path)
    if found is not None and found.name.endswith(".index.json"):
        raw = json.loads(found.read_bytes())
        return [path / f for f in dict.fromkeys(raw["weight_map"].values())], dict(raw.get("metadata") or {})
    if found is not None:
        return [found], None
    bins = pretrained.hf_bin_weights(path)
    if bins:  # the weights are there, in a format this loader does not read (probe 38C: said "not found")
        raise CheckpointError(
            f"{path}: holds {' and '.join(bins)}, and zero3.from_pretrained reads only safetensors weights "
            "(model.safetensors or model.safetensors.index.json). Load the .bin with zero3.pretrained.load_state_dict: "
            "build the model under zero3.Init from its config (AutoModelForCausalLM.from_config(AutoConfig."
            "from_pretrained(path))), then zero3.pretrained.load_state_dict(model, path/'pytorch_model.bin') (a "
            "sharded one: each shard file with strict=False); or save it once as safetensors (transformers' "
            "save_pretrained(..., safe_serialization=True)). Nothing was loaded")
    raise CheckpointNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json in it; "
                                  "zero3.from_pretrained reads a local safetensors directory")


def _resolve_config(transformers: Any, cls_or_auto: Any, path: Path, config: Any,
                    hf_kwargs: dict) -> tuple[type, Any, dict]:
    """(model class, config, the kwargs left for the model's ``__init__``), as transformers resolves them."""
    kwargs = dict(hf_kwargs)
    attn = kwargs.pop("attn_implementation", None)
    auto = hasattr(cls_or_auto, "_model_mapping")
    if isinstance(config, transformers.PreTrainedConfig):
        config, model_kwargs = copy.deepcopy(config), kwargs
    else:
        config_cls = transformers.AutoConfig if auto else cls_or_auto.config_class
        config, model_kwargs = config_cls.from_pretrained(config if config is not None else path,
                                                          return_unused_kwargs=True, **kwargs)
    if attn is not None:
        config._attn_implementation = attn
    if auto:
        from transformers.models.auto.auto_factory import _get_model_class
        return _get_model_class(config, cls_or_auto._model_mapping), config, model_kwargs
    return cls_or_auto, config, model_kwargs


def _build(transformers: Any, model_cls: type, config: Any, model_kwargs: dict, dtype: torch.dtype,
           zero_config: Any, group: Any) -> nn.Module:
    """The model under `zero3.Init`, in ``dtype``, without random init, tied as ``from_config`` ties.
    ``sync="none"``: every value is loaded or initialised with rank 0's (`_initialize_missing`), so the
    ranks' uninitialised memory need not agree (the check would broadcast it and warn)."""
    from transformers import initialization, modeling_utils
    from transformers.monkey_patching import apply_patches

    # transformers builds on meta, which draws nothing from the RNG; a module's __init__ that draws
    # (ViT's torch.randn cls_token) would move the draws of the missing weights' init (probe 29E).
    rng = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=rng), modeling_utils.local_torch_dtype(dtype, model_cls.__name__), \
            initialization.no_init_weights(), apply_patches(), Init(config=zero_config, group=group, sync="none"):
        model = model_cls(config, **model_kwargs)
        # no_init_weights skips init_weights(), and with it the tying transformers does in it.
        model.tie_weights(recompute_mapping=False)
    return model


def _renamed_source(transformers: Any, model: nn.Module, source: Any) -> Any:
    """The checkpoint under the model's names: transformers' renamings and base-model prefix applied."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model, None, None)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    expected = dict.fromkeys(model.state_dict(keep_vars=True), True)
    prefix = model.base_model_prefix
    new_to_old: dict[str, str] = {}
    converted = []
    for old in source.keys():
        new, pattern = rename_source_key(old, renamings, converters, prefix, expected)
        if new not in expected and old in expected:
            new, pattern = rename_source_key(old, [], [], prefix, expected)
        if pattern is not None and new in expected:
            converted.append(old)
        new_to_old.setdefault(new, old)
    if converted:
        source.close()
        raise ZeroConfigError(f"{type(model).__name__}: checkpoint tensors {converted[:3]} need transformers' weight "
                              "conversion (fused or split on load); zero3.from_pretrained only renames keys")
    return pretrained.RenamedSource(source, new_to_old)


def _drop_mismatched(model: nn.Module, source: pretrained.RenamedSource) -> tuple[pretrained.RenamedSource, set]:
    """The source without the tensors whose shape is not the model's, and transformers' mismatched-key
    triples (name, checkpoint shape, model shape) for them."""
    mismatched = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in source.old:
            continue
        want = tuple(tensor._zero.shape if isinstance(tensor, ZeroParameter) else tensor.shape)
        have = tuple(source.shape(name))
        if have != want:
            mismatched.add((name, torch.Size(have), torch.Size(want)))
    dropped = {name for name, _, _ in mismatched}
    kept = {new: old for new, old in source.old.items() if new not in dropped}
    return pretrained.RenamedSource(source.inner, kept), mismatched


def _refuse_differing_tied_pair(model: nn.Module, source: Any) -> None:
    """Both names of a tied pair in the checkpoint, with different values: transformers unties them (and
    warns); zero3 tied them while building, so it refuses. Each rank compares only its own slice of the
    two (`pretrained.same_values`, as `zero3.pretrained.load_state_dict` compares any tied names), and
    the ranks agree on the outcome."""
    keys = set(source.keys())
    differ = []
    error: BaseException | None = None
    try:  # a read that fails (a pair of other shapes) is agreed on below too, not raised on one rank
        for target, tied_to in getattr(model, "all_tied_weights_keys", {}).items():
            if target not in keys or tied_to not in keys or source.shape(target) != source.shape(tied_to):
                continue  # of other shapes: match_keys lists the shape mismatch
            if not pretrained.same_values(source, tied_to, target, model.get_parameter(tied_to)):
                differ.append(f"{tied_to} and {target}")
    except Exception as exc:  # noqa: BLE001 - agreed across ranks below
        error = exc
    params = [p for p in model.parameters() if isinstance(p, ZeroParameter)]
    if differ:
        error = ZeroConfigError(f"the checkpoint holds both {differ[0]}, with different values, but the config ties "
                                "them; transformers would untie them, zero3.from_pretrained does not. Pass a config "
                                "with tie_word_embeddings=False")
    if params:
        exchange(params[0]._zero.ctx, None, error, "zero3.from_pretrained tied weights")
    if error is not None:
        raise error


def _loading_info(modeling_utils: Any, model: nn.Module, keys: pretrained.LoadResult, mismatched: set) -> Any:
    """transformers' ``LoadStateDictInfo``, adjusted by the model's ``_keys_to_ignore_on_load_*``; the
    mismatched keys are reported as such, not as missing (they are initialised as missing ones are)."""
    # The sets filled as transformers fills them (all keys, then the loaded ones discarded), so that they
    # iterate, and the report lists them, in the same order.
    from transformers.core_model_loading import dot_natural_key

    missing = set(model.state_dict(keep_vars=True))
    skipped = {name for name, _, _ in mismatched}
    missing.difference_update([k for k in list(missing) if k not in set(keys.missing_keys) or k in skipped])
    unexpected = set(sorted(keys.unexpected_keys, key=dot_natural_key))
    info = modeling_utils.LoadStateDictInfo(missing_keys=missing, unexpected_keys=unexpected,
                                            mismatched_keys=mismatched, error_msgs=[], conversion_errors={},
                                            skipped_pp_keys=set())
    model._adjust_missing_and_unexpected_keys(info)
    return info


def _initialize_missing(model: nn.Module, missing: set[str]) -> None:
    """transformers' ``_init_weights`` on what the checkpoint lacked, as ``from_pretrained`` runs it.

    Loaded tensors carry ``_is_hf_initialized``, which transformers' init functions skip; the others
    (and the non-persistent buffers, which transformers recomputes too) are initialised in the
    module order and with the RNG draws of a plain ``from_pretrained``, rank 0's values winning."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in missing:
            tensor._is_hf_initialized = True
    todo = {id(t): t for n, t in model.state_dict(keep_vars=True).items() if n in missing}
    # A parametrized module's weight is computed from its originals whenever it is read, and the init
    # functions read every module's weight (probe 29E: Wav2Vec2's weight-norm conv raised there).
    todo.update((id(p), p) for m in model.modules() if parametrize.is_parametrized(m)
                for p in m.parametrizations.parameters())
    params = [t for t in todo.values() if isinstance(t, ZeroParameter)]
    with GatheredParameters(params, modifier_rank=0):
        model.initialize_weights()


__all__ = ["from_pretrained"]
