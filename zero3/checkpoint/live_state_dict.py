"""The full state dict of a live engine (``engine.consolidated_state_dict``): every module's master
shards gathered with one collective per dtype, onto rank 0 or every rank, with the modules' extra state.

The offline counterpart, from a checkpoint directory without a model, is consolidate.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..comm.communicator import Kind, Tag
from ..partition.param import ZeroParameter
from .consolidate import cast_floating, check_cast_dtype
from .layout import extra_state_modules

if TYPE_CHECKING:
    from ..runtime.context import RuntimeContext


def consolidated_state_dict(ctx: RuntimeContext, rank0_only: bool = True, *,
                            dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The full state dict of the engine's model (the tensors the optimizer steps on: fp32 masters
    where masters are separate, else the shards), built module by module.

    A collective. Each module's master shards are gathered with one collective per dtype, straight onto rank 0
    (``rank0_only``) or onto every rank, so the other ranks never hold more than their shards. Tied
    parameters stay tied: both names map to the same tensor object, as in ``model.state_dict()``. A
    module that overrides ``get_extra_state`` adds its ``<prefix>._extra_state`` key with the value
    ``get_extra_state()`` returns, as ``model.state_dict()`` holds it (not copied or cast).

    Args:
        ctx: the engine's runtime context (``engine.context``).
        rank0_only: only rank 0 gets the tensors; the others get ``{}``.
        dtype: cast floating-point tensors to this dtype (default: as stepped: fp32 masters, a frozen
            parameter's shard in its dtype).

    Returns:
        ``{name: CPU tensor or extra state}`` in ``model.state_dict()`` order (``{}`` off rank 0 with ``rank0_only``).
    """
    assert ctx.module is not None
    check_cast_dtype(dtype, "consolidated_state_dict(dtype=...)")
    ctx.require_states("consolidated_state_dict", ("lp_params", "hp_params"))
    ctx.take_persistent_writes()  # in-place writes to kept-gathered parameters are saved
    keep = ctx.rank == 0 or not rank0_only
    full: dict[int, torch.Tensor] = {}
    done: set[int] = set()
    for module in ctx.module.modules():
        params = []
        for p in module._parameters.values():
            if isinstance(p, ZeroParameter) and id(p) not in done:
                done.add(id(p))
                params.append(p)
        if params:
            for p, t in zip(params, _gather_masters(ctx, params, rank0_only)):
                if keep:
                    full[id(p)] = cast_floating(t, dtype)
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    # By name: tied names share one parameter and so one gathered master.
    by_name = dict(ctx.module.named_parameters(remove_duplicate=False))
    extra = extra_state_modules(ctx.module)
    for key, value in ctx.module.state_dict(keep_vars=True).items():
        p = by_name.get(key)
        if isinstance(p, ZeroParameter):
            out[key] = full[id(p)]
        elif key in extra:
            out[key] = value
        elif isinstance(value, torch.Tensor):
            out[key] = cast_floating(value.detach().to("cpu", copy=True), dtype)
    return out


def _gather_masters(ctx: RuntimeContext, params: list[ZeroParameter], rank0_only: bool) -> list[torch.Tensor]:
    """Full master tensors (on the CPU) of ``params``, one collective per dtype; ``[]`` where not received."""
    with ctx.resident(params):  # read in when they live on NVMe
        return _gather_resident(ctx, params, rank0_only)


def _gather_resident(ctx: RuntimeContext, params: list[ZeroParameter], rank0_only: bool) -> list[torch.Tensor]:
    masters = [p._zero.train_tensor for p in params]
    receive = ctx.rank == 0 or not rank0_only
    out: dict[int, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, m in enumerate(masters):
        by_dtype.setdefault(m.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([masters[i].detach().reshape(-1) for i in idx])
        tag = Tag(Kind.GATHER_TO_ROOT if rank0_only else Kind.TENSOR_GATHER, "consolidated_state_dict",
                  tuple(params[i]._zero.id for i in idx))
        rows = ctx.comm.gather_to_rank0(flat, tag) if rank0_only else ctx.comm.all_gather_tensor(flat, tag)
        if rows is None:
            continue
        off = 0
        for i in idx:
            p = params[i]
            s = masters[i].numel()
            out[i] = rows[:, off: off + s].reshape(-1)[: p._zero.numel].view(p._zero.shape).to("cpu", copy=True)
            off += s
    return [out[i] for i in range(len(params))] if receive else []


__all__ = ["consolidated_state_dict"]
