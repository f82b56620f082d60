"""A model's own ``load_state_dict`` hooks, which `zero3.pretrained.load_state_dict` does not run.

torch runs each module's pre-hooks on a filtered copy of the state dict holding that module's keys
(so a hook renames only its module's keys), with the running missing and unexpected lists, and the
post-hooks children first. zero3 matches every key against the model at once and copies each
rank's slice itself, and a pre-hook that rewrites a dict cannot run over a file read slice by slice.
A first attempt at running them anyway (probe 29D: a legacy-key renaming hook was skipped) differed
from torch in five ways and refused files that load today (review 29Z1). So they are not run, as
before, and each is named in a WARNING (once per hook and module), instead of a load that says only
that every key was missing or unexpected; three of torch's that change nothing for a checkpoint of
the model as it is (`_QUIET`) are documented instead (docs/api.md)."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ..config.sections import warn_once
from ..runtime.gathered import keep_finer, refuse_assign, refuse_partitioned_load, write_back_loaded


def _own(fn: Any) -> bool:
    return fn is refuse_assign or isinstance(fn, functools.partial) and fn.func in (
        keep_finer, write_back_loaded, refuse_partitioned_load)


# torch's hooks that change nothing for a checkpoint of the model as it is: the weight-norm and
# spectral-norm ones convert old checkpoints' keys, the lazy modules' fills in a shape (refused at
# initialize). Every other hook is named, torch's checkpoint_wrapper's too (review 29Z2: it renames).
_QUIET = ("torch.nn.utils.parametrizations", "torch.nn.utils.spectral_norm", "torch.nn.modules.lazy")


def warn_skipped_hooks(module: nn.Module) -> None:
    """A WARNING for each load hook of ``module``'s tree that is neither zero3's nor in `_QUIET`
    (once per hook and module); never raises."""
    for prefix, m in module.named_modules():
        hooks = [("pre-hook", h) for h in m._load_state_dict_pre_hooks.values()]
        hooks += [("post-hook", h) for h in m._load_state_dict_post_hooks.values()]
        for kind, hook in hooks:
            fn = getattr(hook, "hook", hook)  # torch's _WrappedHook keeps the function as .hook
            if _own(fn):
                continue
            inner = fn.func if isinstance(fn, functools.partial) else fn
            where = getattr(inner, "__module__", None)
            if isinstance(where, str) and where.startswith(_QUIET):
                continue
            name = getattr(inner, "__qualname__", None)
            name = name if isinstance(name, str) else type(inner).__qualname__
            effect = ("keys it would rename are not renamed" if kind == "pre-hook"
                      else "what it would do after the load is not done")
            warn_once(f"zero3.pretrained.load_state_dict does not run load_state_dict hooks: the {kind} {name} "
                      f"on {prefix or 'the model'} ({type(m).__name__}) is skipped, so {effect}. Rename keys in "
                      "the state dict before loading (docs/api.md)")
