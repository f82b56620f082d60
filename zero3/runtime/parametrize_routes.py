"""Torch's calls that rewrite a module's parameters (``torch.nn.utils.parametrize``, the parametrizations
built on it, the deprecated ``weight_norm``, ``torch.nn.utils.prune``), routed through zero3's checks once
zero3 is in use: refused where they would replace a partitioned parameter or leave its module half
rewritten, before torch changes anything, and given memory of their own where they would keep a view of
a gathered parameter's. Torch's functions are taken when zero3 is imported, so a route installed while
``zero3.Init`` has its own patches on (`route_parametrizations`) wraps torch's, never Init's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.weight_norm import WeightNorm

from ..errors import ZeroStateError
from ..partition.conversion import building
from ..partition.param import PartitionedParameter, ZeroParameter
from .adopt import take_from_rank0

_TORCH_REGISTER = parametrize.register_parametrization  # torch's, as imported: what the routes call
_TORCH_REMOVE = parametrize.remove_parametrizations
_TORCH_WEIGHT_NORM_APPLY = WeightNorm.apply
_TORCH_PRUNE_APPLY = prune.BasePruningMethod.__dict__["apply"].__func__
_TORCH_PRUNE_REMOVE = prune.remove


def route_parametrizations() -> None:
    """From the first ``initialize`` or modifier block on, ``parametrize.register_parametrization`` (which
    ``parametrizations.weight_norm``, ``orthogonal`` and ``spectral_norm`` call) refuses a partitioned
    parameter of an engine's model: it moves the parameter into a new module (a ``ParametrizationList``)
    that has none of the hooks installed at ``initialize``, so nothing gathers it there. Inside
    ``GatheredParameters`` it was accepted and the next forward failed (probe 25B). And
    ``parametrize.remove_parametrizations`` refuses, before torch changes anything, the removals that
    cannot work on a partitioned original (`_removal_refusal`). A parametrization of a gathered
    parameter before ``initialize`` (in a modifier block after ``Init``) gets originals of its own
    memory (`_own_memory`), and so does the deprecated ``weight_norm``, which is refused on a
    partitioned parameter before it drops the weight. Each is installed where torch's own is in place
    (not over ``Init``'s patches, which hand on to what they replaced)."""
    if parametrize.register_parametrization is _TORCH_REGISTER:
        parametrize.register_parametrization = _register_parametrization
    if parametrize.remove_parametrizations is _TORCH_REMOVE:
        parametrize.remove_parametrizations = _remove_parametrizations
    if WeightNorm.apply is _TORCH_WEIGHT_NORM_APPLY:
        WeightNorm.apply = staticmethod(_weight_norm_apply)  # type: ignore[method-assign, assignment]


def _own_memory(params: Any, p: Any) -> None:
    """Give each plain tensor of ``params`` that views the gathered ``p``'s memory a copy of its own:
    weight_norm's ``weight_v``/``original1`` is ``Parameter(weight)``, and the release at the block's
    end empties that memory, so after ``Init`` (which partitions it first) it was left on 0 bytes and
    ``initialize`` crashed reading it (probe 37A)."""
    if not isinstance(p, ZeroParameter) or p.untyped_storage().nbytes() == 0:  # not zero3's, or not gathered
        return
    ptr = p.untyped_storage().data_ptr()
    for q in list(params):
        if not isinstance(q, ZeroParameter) and q.layout is torch.strided and q.untyped_storage().data_ptr() == ptr:
            q.data = q.data.clone()


def _weight_norm_apply(module: nn.Module, name: str, dim: int) -> Any:
    """The deprecated ``torch.nn.utils.weight_norm``: it drops the weight before it reads it, so on a
    partitioned one the guard's error left the module without it (probe 37A); refused first."""
    p = module._parameters.get(name)
    what = f"torch.nn.utils.weight_norm of {p._zero.name}" if isinstance(p, ZeroParameter) else ""
    if _engine_context(p) is not None:
        raise ZeroStateError(
            f"{what} after zero3.initialize: it replaces the parameter with weight_g and weight_v, new parameters "
            "that zero3.initialize did not partition and the optimizer does not hold. Apply it before "
            "zero3.initialize (inside zero3.Init, on the plain model, or inside `with zero3.GatheredParameters("
            "list(module.parameters()), modifier_rank=0):`). Nothing was changed")
    if isinstance(p, PartitionedParameter) and not _built_now(p):
        raise ZeroStateError(
            f"{what} while it is partitioned: torch drops the weight before it reads its values, which are in "
            "shards. Apply it inside `with zero3.GatheredParameters(list(module.parameters()), modifier_rank=0):` "
            "(a collective: on every rank alike) before zero3.initialize. Nothing was changed")
    fn = _TORCH_WEIGHT_NORM_APPLY(module, name, dim)
    if p is not None:
        _own_memory(module._parameters.values(), p)
    return fn


def _engine_context(p: Any) -> Any:
    """The context of the engine whose hooks manage ``p`` now, or None (not zero3's, no engine yet, or
    after its ``remove_hooks``)."""
    ctx = p._zero.ctx if isinstance(p, ZeroParameter) else None
    return ctx if ctx is not None and getattr(ctx, "attached", False) else None


def _register_parametrization(module: nn.Module, tensor_name: str, parametrization: nn.Module, *,
                              unsafe: bool = False) -> nn.Module:
    p = module._parameters.get(tensor_name) if isinstance(module, nn.Module) else None
    ctx = _engine_context(p)
    if ctx is not None and ctx.module is not None and not p._zero.persistent:
        raise ZeroStateError(
            f"register_parametrization of {p._zero.name} (torch.nn.utils.parametrize, parametrizations.weight_norm, "
            "orthogonal, spectral_norm) after zero3.initialize: the parameter would move into a new module that has "
            "none of the hooks installed at initialize, so nothing would gather it. Register parametrizations "
            "before zero3.initialize (on the built model, or inside zero3.Init); nothing was changed")
    if ctx is not None and ctx.module is not None and hasattr(parametrization, "right_inverse"):
        devices = [p.device.index or 0] if p.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices):  # persistent, so gathered: what torch computes
            originals = parametrization.right_inverse(p)  # first, once more; a draw in it (orthogonal's base
        # of a non-square weight) is drawn again alike by torch's call (review 37R2: it shifted the stream)
        if not isinstance(originals, torch.Tensor):
            raise ZeroStateError(  # torch failed wrapping the parameter's class (probe 37A)
                f"register_parametrization of {p._zero.name} after zero3.initialize: its right_inverse gives "
                f"{len(originals)} originals (parametrizations.weight_norm's original0/original1), new parameters "
                "that zero3.initialize did not partition and the optimizer does not hold. Register it before "
                "zero3.initialize (on the built model, inside zero3.Init, or inside zero3.GatheredParameters(..., "
                "modifier_rank=0)); nothing was changed")
    result = _TORCH_REGISTER(module, tensor_name, parametrization, unsafe=unsafe)
    if p is not None:
        _own_memory(module.parametrizations[tensor_name].parameters(), p)
    return result


def _remove_parametrizations(module: nn.Module, tensor_name: str, leave_parametrized: bool = True) -> nn.Module:
    refusal = _removal_refusal(module, tensor_name, leave_parametrized)
    if refusal is not None:
        raise refusal
    return _TORCH_REMOVE(module, tensor_name, leave_parametrized)


def _removal_refusal(module: nn.Module, tensor_name: str, leave_parametrized: bool) -> ZeroStateError | None:
    """What ``remove_parametrizations(module, tensor_name, leave_parametrized)`` cannot do with
    partitioned originals, checked before torch changes anything (every other removal is torch's:
    one keeping its single original trains as torch's, gathered or not). With several originals
    (``parametrizations.weight_norm``'s ``original0``/``original1``) torch registers a new parameter
    computed from them and drops them: after ``initialize`` no shard, hook or optimizer holds it, so
    the next forward failed and the trained originals were gone (probe 31H). With one original torch
    writes the value into it with ``Tensor.set_``, which a partitioned parameter refuses only once
    torch has wrapped that refusal in a RuntimeError advising a torch flag."""
    parametrizations = getattr(module, "parametrizations", None)
    plist = parametrizations[tensor_name] if isinstance(parametrizations, nn.ModuleDict) \
        and tensor_name in parametrizations else None
    if plist is None or not leave_parametrized:
        return None  # torch's own error, or the original handed back as it is
    originals = list(plist._parameters.values())
    call = f"remove_parametrizations(module, {tensor_name!r}) (leave_parametrized=True, torch's default)"
    if not plist.is_tensor:
        p = next((p for p in originals if _engine_context(p) is not None), None)
        if p is None:
            return None
        return ZeroStateError(
            f"{call} of {p._zero.name} after zero3.initialize: the parametrization has {len(originals)} originals "
            "(weight_norm's original0/original1), so torch would replace them with a new parameter computed from "
            "them, which zero3.initialize did not partition and the optimizer does not hold: it could not be "
            "gathered or trained, and the originals would be lost. Remove it before zero3.initialize (inside "
            "zero3.Init, on a plain model, or inside zero3.GatheredParameters(..., modifier_rank=0)); to export "
            "the folded weight, load engine.consolidated_state_dict() into "
            "a plain copy of the model and remove it there; to train on folded, call engine.remove_hooks(), remove "
            "it inside `with zero3.GatheredParameters(list(module.parameters()), modifier_rank=0):` and "
            "zero3.initialize the model anew. Nothing was changed")
    original = originals[0] if originals else None
    if isinstance(original, PartitionedParameter) and not _built_now(original):
        return ZeroStateError(
            f"{call} of {original._zero.name}: torch writes the parametrized value into the original with "
            "Tensor.set_, which a partitioned parameter cannot take (its data is in shards). Remove it inside "
            "`with zero3.GatheredParameters([original], modifier_rank=0):` (a collective: on every rank alike), or "
            "pass leave_parametrized=False to keep the original's own values. Nothing was changed")
    return None


def route_pruning() -> None:
    """From the first ``initialize`` on, torch's pruning (``prune.l1_unstructured``, ``random_unstructured``,
    ``ln_structured``, ``custom_from_mask``, ``global_unstructured``: each a ``BasePruningMethod.apply``)
    refuses a partitioned parameter that is not gathered before torch changes anything. Torch moves
    ``weight`` to ``weight_orig`` (or takes the module's pruning hook off) before its first use of the
    values, where the parameter's guard raised: the module was left without ``weight`` and without the
    hook, its forward failed, and so did the retry the guard's error suggests (probe 31H). So does
    ``prune.remove``. At world size above 1 the new mask is rank 0's on every rank (each drew its own).
    """
    if prune.BasePruningMethod.__dict__["apply"].__func__ is _TORCH_PRUNE_APPLY:
        prune.BasePruningMethod.apply = classmethod(_prune_apply)  # type: ignore[method-assign,assignment]
    if prune.remove is _TORCH_PRUNE_REMOVE:
        prune.remove = _prune_remove


def _built_now(p: ZeroParameter) -> bool:
    """``p`` belongs to no engine and a ``zero3.Init`` is open, whose construction handler gathers it on
    use (an engine's parameter is not, inside another model's ``Init``: review 31RC)."""
    return building() and _engine_context(p) is None


def _prune_refusal(p: Any, what: str, name: str) -> ZeroStateError | None:
    if not isinstance(p, PartitionedParameter) or _built_now(p):
        return None
    return ZeroStateError(
        f"{what} of {p._zero.name} (torch.nn.utils.prune) while it is partitioned: torch moves it to or from "
        f"{name}_orig before it reads its values, which are in shards. Prune inside `with "
        "zero3.GatheredParameters([param], modifier_rank=0):` (a collective: on every rank alike; the pruned "
        "module then trains as torch's), or before zero3.Init/initialize. Nothing was changed")


def _prune_apply(cls: type, module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    p = module._parameters.get(name, module._parameters.get(f"{name}_orig")) if isinstance(module, nn.Module) else None
    refusal = _prune_refusal(p, f"pruning ({cls.__name__})", name)
    if refusal is not None:
        raise refusal
    out = _TORCH_PRUNE_APPLY(cls, module, name, *args, **kwargs)
    ctx = _engine_context(module._parameters.get(f"{name}_orig"))
    if ctx is not None and ctx.world_size > 1:
        # each rank drew its own mask (random methods, per-rank importance scores): rank 0's for all, or
        # the ranks trained different models (0.25 apart, review 31RC); a collective, as the pruning is
        take_from_rank0(ctx.comm, [(f"{p._zero.name}: {name}_mask", getattr(module, f"{name}_mask"))],
                        what="pruning mask", log=False)
        setattr(module, name, out.apply_mask(module))  # torch set it from this rank's own mask (review 31RD)
    return out


def _prune_remove(module: nn.Module, name: str) -> nn.Module:
    refusal = _prune_refusal(module._parameters.get(f"{name}_orig") if isinstance(module, nn.Module) else None,
                             "prune.remove", name)
    if refusal is not None:
        raise refusal
    return _TORCH_PRUNE_REMOVE(module, name)
