"""DeepSpeed's names over zero3, for code written against DeepSpeed ZeRO-3: ``import zero3.deepspeed as
deepspeed`` and ``deepspeed.zero.Init(...)``, ``deepspeed.initialize(model=..., config=...)`` (the
4-tuple), ``deepspeed.zero.GatheredParameters``, ``deepspeed.checkpointing.checkpoint``, ... keep working
with their meaning. Only what zero3 implements is here; anything else is an AttributeError, never a
silent stand-in.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..engine import Engine
from ..engine import initialize as _initialize
from ..errors import ZeroConfigError
from ..memory import see_memory_usage
from . import checkpointing
from . import utils
from . import zero
from .distributed import init_distributed
from .distributed import launched as _launched

logger = logging.getLogger(__name__)

__all__ = ["add_config_arguments", "checkpointing", "init_distributed", "initialize", "see_memory_usage", "utils",
           "zero"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--deepspeed`` (a flag scripts test) and ``--deepspeed_config PATH`` (read by `initialize` from
    ``args``), and DeepSpeed's deprecated spellings of both, ``--deepscale`` and ``--deepscale_config``
    (DeepSpeed's parser still takes them, so a launch line carrying them must parse), in a "DeepSpeed"
    argument group of ``parser``; returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train with the config below")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated name of --deepspeed_config (read with a warning)")
    return parser


def _config_of_args(args: Any) -> Any:
    """The config an ``argparse.Namespace`` carries: ``deepspeed_config``, or DeepSpeed's legacy
    ``deepscale_config`` (accepted, as DeepSpeed accepts it, with a warning; both given are refused,
    as DeepSpeed refuses them). A dict or a string is not a namespace: refused, naming ``config=``."""
    if args is None:
        return None
    if isinstance(args, (dict, str, bytes)) or not hasattr(args, "__dict__"):
        raise ZeroConfigError(f"deepspeed.initialize: args must be an argparse.Namespace (DeepSpeed reads "
                              f"args.deepspeed_config), got {type(args).__name__}: pass a config dict or JSON path "
                              "as config=")
    found = getattr(args, "deepspeed_config", None)
    legacy = getattr(args, "deepscale_config", None)
    if legacy is not None:
        if found is not None:
            raise ZeroConfigError(f"deepspeed.initialize got args.deepspeed_config={found!r} and "
                                  f"args.deepscale_config={legacy!r}: pass only --deepspeed_config (--deepscale_config "
                                  "is its deprecated name)")
        logger.warning("zero3: args.deepscale_config is DeepSpeed's old name; use args.deepspeed_config")
        found = legacy
    return found


def _no_config_in_args(args: Any) -> str:
    """Why ``args`` carries no config: no ``deepspeed_config`` attribute at all, or one left None
    (what `add_config_arguments` gives when ``--deepspeed_config`` is not on the command line)."""
    if hasattr(args, "deepspeed_config"):
        return (f"deepspeed.initialize got args={args!r} whose deepspeed_config is None (--deepspeed_config was not "
                "passed) and no config")
    return f"deepspeed.initialize got args={args!r} without a deepspeed_config attribute and no config"


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               config_params: Any = None) -> tuple[Engine, Any, None, Any]:
    """``deepspeed.initialize``: returns ``(engine, optimizer, None, lr_scheduler)``.

    ``optimizer`` is the engine's sharded optimizer (``.overflow``, ``.param_groups``, ``.step``
    around the user's torch optimizer). The config comes from ``config``, ``config_params`` or
    ``args.deepspeed_config``. ``training_data`` is refused: build your own DataLoader with a
    ``DistributedSampler``. ``dist_init_required``: True calls `init_distributed` (a no-op when a
    process group exists); None does so when a launcher set ``RANK``/``WORLD_SIZE`` and no group
    exists (a plain single process keeps zero3's mode without torch.distributed); False requires
    an initialized group.
    """
    if training_data is not None or collate_fn is not None:
        raise ZeroConfigError("zero3.deepspeed.initialize does not build data loaders (training_data / "
                              "collate_fn); build a torch DataLoader with a DistributedSampler yourself")
    from_args = _config_of_args(args)
    configs = [c for c in (config, config_params, from_args) if c is not None]
    if len(configs) > 1:
        raise ZeroConfigError("pass the config once: config, config_params or args.deepspeed_config")
    if args is not None and from_args is None and not configs:
        raise ZeroConfigError(f"{_no_config_in_args(args)}: pass the config as config= (a dict or a JSON path), or "
                              "args from deepspeed.add_config_arguments(parser) with --deepspeed_config")
    if not configs:
        raise ZeroConfigError("deepspeed.initialize got no config (DeepSpeed requires one): pass config= (a dict or a "
                              "JSON path), config_params=, or args with --deepspeed_config; config={} takes zero3's "
                              "defaults")
    if dist_init_required or (dist_init_required is None and _launched()):
        init_distributed()
    elif dist_init_required is False and not (dist.is_available() and dist.is_initialized()):
        raise ZeroConfigError("deepspeed.initialize(dist_init_required=False) but torch.distributed is not "
                              "initialized: call deepspeed.init_distributed() (or torch.distributed."
                              "init_process_group) first, or leave dist_init_required unset")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) and model_parameters is None:
        model_parameters = list(model.parameters())  # DeepSpeed calls a client optimizer callable over these
    engine = _initialize(model, optimizer, configs[0] if configs else None, model_parameters=model_parameters,
                         lr_scheduler=lr_scheduler, mpu=mpu)
    return engine, engine.sharded_optimizer, None, engine.lr_scheduler
