"""Compiled blocks: ``torch.compile`` per block with zero3's hooks outside every compiled graph.

[Note: where the hooks sit]
zero3 drives gathers from Python module hooks (runtime/hooks.py) that call the coordinator, issue
collectives and move a state machine. Dynamo cannot trace those into a graph: ``block.compile()``
(which compiles ``_call_impl``, hooks included) or ``torch.compile(model)`` would break the graph at
every hook of every submodule, or fail. `compile_blocks` instead

1. makes each block a leaf module (runtime/leaf.py): zero3 hooks only the block itself, so its whole
   subtree is gathered at the block's entry, released at its exit, regathered before its backward;
2. replaces the block's *inner* ``forward`` with ``torch.compile(block.forward)``. ``nn.Module``'s
   ``_call_impl`` still runs in Python and calls the block's hooks around it: the pre-forward hook
   (gather, input wrapping for the post-backward), then the compiled graph, then the post-forward
   hook (release, a gradient hook on the outputs for the pre-backward).

So every compiled graph holds a whole block's forward (and AOTAutograd's matching backward) and no
zero3 code: the graph breaks sit exactly at the block boundaries. The parameters enter the graph as
inputs while gathered (their class then is exactly ``nn.Parameter``); releasing
resizes their storage to 0 bytes and regathering refills the same storage, so the tensors the
compiled backward saved see the gathered values again, as in eager mode. Dynamo guards on the
parameters' metadata (shape, stride, dtype, class, ``requires_grad``), not on their addresses or on
which block they belong to, so blocks of one class share one compiled graph and a step recompiles
nothing once the first step compiled it (a no-grad forward, e.g. generation or an activation
checkpoint's first run, compiles a second variant once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import ZeroConfigError, ZeroStateError
from .leaf import find_modules, mark_leaf

COMPILED_ATTR = "_zero3_compiled_forward"


def compile_blocks(model: nn.Module, targets: Iterable[type | str], *, backend: str = "inductor",
                   **compile_kwargs: Any) -> list[nn.Module]:
    """Compile the forward of each block of ``model`` and make the block one zero3 unit.

    Call it after building the model (under ``zero3.Init`` or not) and before ``zero3.initialize``:
    the hooks installed then must see the blocks as leaf modules. Compilation itself is lazy (the
    first forward of each block class compiles).

    Args:
        model: the model.
        targets: block classes, class names or qualified module names, as for `set_leaf_modules`.
        backend: ``torch.compile``'s backend ("inductor"; "aot_eager" or "eager" compile faster).
        **compile_kwargs: passed to ``torch.compile`` (``mode``, ``dynamic``, ``fullgraph``, ...).

    Returns:
        The compiled blocks.

    Raises:
        ZeroStateError: ``model`` was already given to ``zero3.initialize``, or a block is already
            compiled by this function.
        ZeroConfigError: a target matches no module; the model or a block was compiled with
            ``torch.compile(module)`` / ``module.compile()``, which traces zero3's hooks; one block
            lies inside another.
    """
    if getattr(model, "__dict__", {}).get("_zero3_context") is not None:
        raise ZeroStateError("compile_blocks must be called before zero3.initialize: initialize installs the "
                             "hooks around each block, and the blocks must be leaf modules by then")
    blocks = _distinct(find_modules(model, targets, "compile_blocks"))
    _check(model, blocks)
    # torch.compile checks its arguments when called: every block's compiled forward first, then
    # the marks, so a refused mode or keyword leaves no block half-converted
    compiled = [torch.compile(m.forward, backend=backend, **compile_kwargs) for m in blocks]
    for m, forward in zip(blocks, compiled):
        mark_leaf(m, True)  # as set_leaf_modules: gathered, released and reduced as one unit
        # An instance attribute, which nn.Module's __call__ finds before the class's forward; the
        # compiled function wraps the bound method, so it ends in the block's own forward.
        setattr(m, "forward", forward)
        setattr(m, COMPILED_ATTR, True)
    return blocks


def _distinct(blocks: list[nn.Module]) -> list[nn.Module]:
    out: list[nn.Module] = []
    for m in blocks:
        if not any(m is b for b in out):
            out.append(m)
    return out


def _check(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Refuse what would put zero3's hooks inside a compiled graph, or compile a block twice."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ZeroConfigError("compile_blocks: the model is a torch.compile(model) wrapper, whose graph would "
                              "trace zero3's hooks; pass the plain model and let compile_blocks compile its blocks")
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    for m in blocks:
        name = names[id(m)]
        if m.__dict__.get(COMPILED_ATTR):
            raise ZeroStateError(f"compile_blocks: block {name!r} is compiled already")
        if getattr(m, "_compiled_call_impl", None) is not None:
            raise ZeroConfigError(f"compile_blocks: block {name!r} was compiled with module.compile(), which "
                                  "compiles its hooks too (zero3's would break the graph); build it uncompiled")
        for d in m.modules():
            if d is not m and getattr(d, "_compiled_call_impl", None) is not None:
                raise ZeroConfigError(f"compile_blocks: module {names[id(d)]!r} inside block {name!r} was compiled "
                                      "with module.compile(); compile the block only")
        inner = [names[id(b)] for b in blocks if b is not m and any(d is b for d in m.modules())]
        if inner:
            raise ZeroConfigError(f"compile_blocks: {', '.join(map(repr, inner))} lie inside block {name!r}; "
                                  "compile the outer block only (it is gathered as one unit)")
