"""What a module's forward returned, seen from the hooks: the tensors a backward can enter through,
and views of the module's parameters that would outlive their storage.

[Note: module outputs]
The forward post-hook (hooks.py) needs two things of an output, whatever its structure:
- **Where a backward enters** (`_hook_leaves`): a pre-hook on the autograd node of every
  output tensor that needs a gradient is the module's pre-backward, which gathers its parameters
  again. The tensors are found through torch's pytree (tuples, lists, dicts, namedtuples, Hugging
  Face's ``ModelOutput``) and through the fields of dataclasses, which pytree takes for leaves. An
  object neither can open (a class of the user's with tensor attributes) may hide a tensor whose
  backward needs the parameters: the hook reports it, and the module's parameters then stay
  gathered until the step ends (a backward that reads a released parameter reads freed storage).
- **Views of the parameters** (`copy_parameter_views`): a release empties a parameter's storage in
  place, so an output that is a view of it (``return self.prompt[0]``, a positional table sliced
  to the sequence length) or the parameter itself would be read after the release as freed memory.
  Such an output is replaced by a copy made while the parameter is gathered (a clone: autograd
  still reaches the parameter through it). Persistent parameters are never released: their views
  stay views. One difference from torch remains: the copy does not follow later in-place updates
  of the parameter (an optimizer step), which a view in plain torch would.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..partition.param import ZeroParameter, raw_data

_PLAIN = (int, float, complex, str, bytes, slice, range, enum.Enum, type(Ellipsis), torch.dtype, torch.device,
          torch.layout, torch.memory_format, torch.Size)
"""Leaves that hold no tensor (numpy's scalars and arrays too: `_holds_no_tensor`)."""


def _holds_no_tensor(x: Any) -> bool:
    return isinstance(x, _PLAIN) or (type(x).__module__ == "numpy" and getattr(x, "dtype", None) != object)


def _is_dataclass_object(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _hook_leaves(leaves: list[Any], hook: Any, nodes: list[Any]) -> bool:
    """Call ``hook`` when a gradient first reaches the backward of the tensors among ``leaves`` that
    need one (and those in dataclass fields). A tensor made by an autograd node gets a pre-hook on
    that node: it fires at the same point as a tensor hook (before the node, and for the value before
    any later in-place change: the in-place op is a node of its own; a view's in-place change rebases
    it, so its base's node is hooked too, `_hook_tensor`), and costs about 60% of
    `Tensor.register_hook` (no handle dict per tensor). Outputs of one multi-output node share one
    hook. A leaf output has no node: it gets a tensor hook. Returns False when a leaf is an object
    that may hide a tensor (neither pytree nor a dataclass opens it): a backward may then enter
    unseen."""
    seen_all = True
    for t in leaves:
        if isinstance(t, torch.Tensor):
            _hook_tensor(t, hook, nodes)
        elif _is_dataclass_object(t):
            fields = [getattr(t, f.name) for f in dataclasses.fields(t)]
            seen_all = _hook_leaves(pytree.tree_leaves(fields), hook, nodes) and seen_all
        elif t is not None and not _holds_no_tensor(t):
            seen_all = False
    return seen_all


def _hook_tensor(t: torch.Tensor, hook: Any, nodes: list[Any]) -> None:
    if t.requires_grad:
        node = t.grad_fn
        if node is None:
            t.register_hook(hook)
            return
        _hook_node(node, hook, nodes)
        base = t._base  # an in-place op on a view (F.linear of a 3-D input, then relu_) rebases it: the view's
        if base is not None and base.grad_fn is not None:  # node leaves the graph, its base's stays (probe 37N)
            _hook_node(base.grad_fn, hook, nodes)


def _hook_node(node: Any, hook: Any, nodes: list[Any]) -> None:
    if not any(n is node for n in nodes):
        nodes.append(node)
        node.register_prehook(hook)


def prepare_output(output: Any, params: Sequence[ZeroParameter], hook: Any = None) -> tuple[Any, bool]:
    """The forward post-hook's two steps over one walk of ``output``: `copy_parameter_views`, then,
    with a ``hook``, `_hook_leaves` on what is returned. Returns (the output to return, whether
    no object in it may hide a tensor)."""
    if type(output) is torch.Tensor:
        output = copy_parameter_views(output, params)
        if hook is not None:
            _hook_tensor(output, hook, [])
        return output, True
    leaves, spec = pytree.tree_flatten(output)
    if _copy_views_in(leaves, params):
        output = pytree.tree_unflatten(leaves, spec)
    return output, hook is None or _hook_leaves(leaves, hook, [])


def copy_parameter_views(output: Any, params: Sequence[ZeroParameter]) -> Any:
    """``output`` with every tensor that shares storage with one of ``params`` that a release would
    empty (not persistent) replaced by a clone; ``output`` itself when there is none (the usual case:
    an op's fresh result is tested by two attribute reads)."""
    if type(output) is torch.Tensor:
        if not _may_alias(output):
            return output
        ptrs = _releasable_storages(params)
        return output.clone() if ptrs and _shares(output, ptrs) else output
    leaves, spec = pytree.tree_flatten(output)
    return pytree.tree_unflatten(leaves, spec) if _copy_views_in(leaves, params) else output


def _copy_views_in(leaves: list[Any], params: Sequence[ZeroParameter]) -> bool:
    """`copy_parameter_views` over pytree ``leaves``, in place; whether any changed."""
    if not any(_may_alias(t) for t in leaves):
        return False
    ptrs = _releasable_storages(params)
    if not ptrs:
        return False
    changed = False
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and _shares(t, ptrs):
            leaves[i] = t.clone()
            changed = True
        elif _is_dataclass_object(t):
            new = _copy_dataclass_views(t, params)
            if new is not t:
                leaves[i] = new
                changed = True
    return changed


def _may_alias(t: Any) -> bool:
    """Whether ``t`` may share a parameter's storage: a view, or a tensor no op made (the parameter,
    ``.detach()``, ``.data``; under no_grad every output). An op's fresh result (a ``grad_fn`` and no
    base, the usual training output) cannot: tested by two attribute reads."""
    if isinstance(t, torch.Tensor):
        return t._base is not None or t.grad_fn is None
    return _is_dataclass_object(t)


def _copy_dataclass_views(obj: Any, params: Sequence[ZeroParameter]) -> Any:
    new_values = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        new = copy_parameter_views(value, params)
        if new is not value:
            new_values[f.name] = new
    if not new_values:
        return obj
    out = copy.copy(obj)
    for name, value in new_values.items():
        object.__setattr__(out, name, value)  # a frozen dataclass too
    return out


def _releasable_storages(params: Sequence[ZeroParameter]) -> set[int]:
    ptrs = set()
    for p in params:
        if not p._zero.persistent:
            ptr = raw_data(p).untyped_storage().data_ptr()
            if ptr:
                ptrs.add(ptr)
    return ptrs


def _shares(t: torch.Tensor, ptrs: set[int]) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr() in ptrs
