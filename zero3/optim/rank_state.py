"""``optimizer.state_dict()`` of a zero3 optimizer is one rank's shard of the state: tagged with the
rank that saved it, and refused by ``load_state_dict`` on any other.

[Note: per-rank optimizer state]
zero3 re-points the user's optimizer at this rank's shards, so its ``state_dict()`` holds the
moments of 1/world_size of every parameter, and every rank's shards have the same shapes. The
habit of a DDP loop (rank 0 saves ``optimizer.state_dict()``, every rank loads that file) then
gave every rank rank 0's moments without any error. So ``state_dict()`` gains a ``"zero3"`` entry
(rank, world size) and ``load_state_dict`` refuses a state saved by another rank or at another
world size, naming both and the ways out: a file per rank, or ``engine.save_checkpoint`` /
``load_checkpoint`` (which reshard to any world size). A state without the entry (saved by a plain
torch run) is refused where a per-element state's shape differs from the shard it would belong
to, which torch would only have found at the next step, or not at all. Both are checked before
torch's own loading, so a refused load changes nothing. While the state is out of memory (on the
drive under ``offload_optimizer`` nvme, or moved there by ``engine.offload_states``), its tensors
are 0-byte placeholders: ``state_dict()`` would hand them out as if they were the state, and a
load would be overwritten when the state comes back, so both are refused then.

The state is keyed by this rank's shards (the tensors in ``param_groups``), not by the model's
parameters. ``optimizer.state`` is a defaultdict in torch, so a logging line's ``optimizer.state[p]``
for a model parameter returned ``{}`` (no ``exp_avg``: silently wrong) and inserted ``p``, after which
``state_dict()`` failed with a bare ``KeyError`` from inside torch. `ShardKeyedState` refuses a
model parameter as a key (``[]``, ``in``, ``get``, ``setdefault``, ``update``), naming the accessors
that read and write its state.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from ..errors import ZeroStateError
from ..partition.param import ZeroParameter

TAG = "zero3"


def tag_rank_state(optimizer: torch.optim.Optimizer, rank: int, world_size: int, on_drive: bool = False) -> None:
    """Tag ``optimizer``'s state dicts with this rank and check loaded ones (see the Note).
    ``on_drive``: its state lives on NVMe between steps (``offload_optimizer`` nvme), where
    ``state_dict()`` would hand out empty tensors: both calls are refused then."""

    def tag(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        _refuse_out_of_memory(opt, "state_dict()", on_drive, state_dict.get("state", {}))
        state_dict[TAG] = {"rank": rank, "world_size": world_size}
        return state_dict

    def check(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        _refuse_out_of_memory(opt, "load_state_dict()", on_drive, opt.state)
        saved = state_dict.get(TAG)
        if saved is not None:
            if (saved.get("rank"), saved.get("world_size")) != (rank, world_size):
                raise ZeroStateError(
                    f"{type(opt).__name__}.load_state_dict: this state was saved by rank {saved.get('rank')} of "
                    f"{saved.get('world_size')}, and this is rank {rank} of {world_size}. zero3's optimizer holds "
                    "the state of this rank's shards only, so each rank must load the state it saved: save "
                    "optimizer.state_dict() on every rank, to a file per rank, or use engine.save_checkpoint and "
                    "engine.load_checkpoint (any world size); nothing was loaded")
            state_dict = {k: v for k, v in state_dict.items() if k != TAG}
        else:
            _check_shapes(opt, state_dict, world_size)
        return state_dict

    def keyed_by_shard(opt: torch.optim.Optimizer) -> None:  # torch's load puts a new defaultdict there
        opt.state = ShardKeyedState(dict, opt.state)

    optimizer.register_state_dict_post_hook(tag)
    optimizer.register_load_state_dict_pre_hook(check)
    optimizer.register_load_state_dict_post_hook(keyed_by_shard)
    keyed_by_shard(optimizer)


class ShardKeyedState(collections.defaultdict):
    """``optimizer.state`` of a zero3 optimizer: torch's defaultdict, refusing a model parameter as
    a key (see the Note)."""

    def __missing__(self, key: Any) -> Any:
        _check_key(key)
        return super().__missing__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _check_key(key)
        super().__setitem__(key, value)

    def __contains__(self, key: Any) -> bool:
        _check_key(key)
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        _check_key(key)
        return super().get(key, default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        _check_key(key)
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        new = dict(*args, **kwargs)
        for key in new:
            _check_key(key)
        super().update(new)


def _check_key(key: Any) -> None:
    if isinstance(key, ZeroParameter):
        raise _keyed_by_parameter(key)


def _keyed_by_parameter(p: ZeroParameter) -> ZeroStateError:
    return ZeroStateError(
        f"optimizer.state[param] of {p._zero.summary()}: zero3's optimizer keeps the state of this rank's shard "
        "of each parameter, keyed by the shard (the tensors in optimizer.param_groups), so the model's parameter "
        "has no entry. Read it with zero3.safe_get_full_optimizer_state(param, key) (the full tensor; every "
        "rank calls it) or zero3.safe_get_local_optimizer_state(param, key) (this rank's slice), and write it "
        "with zero3.safe_set_full_optimizer_state / safe_set_local_optimizer_state")


def _refuse_out_of_memory(opt: torch.optim.Optimizer, call: str, on_drive: bool, state: Any) -> None:
    """Refuse ``call`` while the state is on the drive: always under ``offload_optimizer`` nvme, or
    while a tensor of ``state`` has fewer bytes of storage than its elements need (offload/states.py
    leaves such placeholders when ``engine.offload_states`` moves the state to NVMe)."""
    moved = not on_drive and any(isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() < v.numel() * v.element_size()
                                 for entry in state.values() for v in entry.values())
    if not (on_drive or moved):
        return
    saving = call == "state_dict()"
    if on_drive:
        where = "with offload_optimizer on NVMe, the optimizer state lives on the drive between steps"
        how = "Save with engine.save_checkpoint (it reads the state from the drive)" if saving else \
            "Resume with engine.load_checkpoint"
    else:
        where = "the optimizer state is out of memory (engine.offload_states to NVMe)"
        how = "Call engine.reload_states() first"
    why = "the state dict would hold empty tensors" if saving else \
        "a state loaded into memory would not reach it (or be overwritten when the state comes back)"
    raise ZeroStateError(f"{type(opt).__name__}.{call}: {where}, so {why}. {how}" + ("" if saving else "; nothing was loaded"))


def _check_shapes(opt: torch.optim.Optimizer, state_dict: dict[str, Any], world_size: int) -> None:
    """An untagged state: each per-element tensor must have its shard's shape."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for index, entry in state_dict.get("state", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entry, dict):
            continue  # torch's loader names what does not fit its param groups
        shard = params[index]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shard.shape:
                raise ZeroStateError(
                    f"{type(opt).__name__}.load_state_dict: state {key!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}, but this rank's optimizer steps on a shard of shape {tuple(shard.shape)} "
                    f"(zero3 keeps 1/{world_size} of every parameter's optimizer state on each rank). The state "
                    "was not saved by a zero3 optimizer at this world size; resume with engine.load_checkpoint "
                    "(any world size), zero3.pretrained.load_state_dict for the weights, or set each parameter's state "
                    "with zero3.safe_set_full_optimizer_state(param, value, key) on every rank; nothing was loaded")
