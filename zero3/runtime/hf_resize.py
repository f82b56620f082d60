"""Hugging Face's ``resize_token_embeddings`` on a zero3 model, refused before transformers changes anything
where zero3 would refuse the new shape afterwards.

zero3 checks a parameter's new shape when the ``GatheredParameters`` block around the resize exits
(gathered.py [Note: a new shape before initialize]): after ``initialize``, or in a block without
``modifier_rank``, it keeps the parameter's shape and values. By then transformers has set
``config.vocab_size`` and the embedding's ``num_embeddings``, and for an untied head built a new output
embedding that no shard, hook or optimizer holds: the next forward failed on a shape, or training went on
with a head that never trained (probe 37G). So the call itself is refused in those placements, and where
the embeddings are partitioned, naming the one placement that works (docs/huggingface.md, "Adding tokens").
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from ..errors import ZeroStateError
from ..partition.conversion import building
from ..partition.param import ZeroParameter
from ..partition.state import ParamStatus
from .handed_copies import OPEN

_ROUTED: list[Any] = []  # transformers' PreTrainedModel.resize_token_embeddings, once wrapped

WHERE = ("inside `with zero3.GatheredParameters([model.get_input_embeddings().weight, "
         "model.get_output_embeddings().weight], modifier_rank=0):` after the zero3.Init block, before "
         "zero3.initialize")


def route_resize() -> None:
    """Wrap ``PreTrainedModel.resize_token_embeddings`` once transformers is imported (else nothing: zero3
    never imports it). Called by ``initialize`` and by every ``GatheredParameters`` entry."""
    if _ROUTED or "transformers" not in sys.modules:
        return
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - a broken transformers install
        return
    original = PreTrainedModel.resize_token_embeddings
    _ROUTED.append(original)

    @functools.wraps(original)
    def resize_token_embeddings(self: Any, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                *args: Any, **kwargs: Any) -> Any:
        if _changes_size(self, new_num_tokens, pad_to_multiple_of):  # else transformers changes nothing (37R3)
            refusal = resize_refusal(self)
            if refusal is not None:
                raise refusal
        return original(self, new_num_tokens, pad_to_multiple_of, *args, **kwargs)

    PreTrainedModel.resize_token_embeddings = resize_token_embeddings


def _changes_size(model: Any, new_num_tokens: int | None, pad_to_multiple_of: int | None) -> bool:
    """Whether the call would give the input embedding another number of rows (None: transformers only
    returns it, or rounds its own size up to ``pad_to_multiple_of``)."""
    embedding = model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, ZeroParameter):
        return True  # not zero3's: transformers decides
    rows = weight._zero.shape[0]
    wanted = rows if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of:
        wanted = -(-wanted // pad_to_multiple_of) * pad_to_multiple_of
    return wanted != rows


def resize_refusal(model: Any) -> ZeroStateError | None:
    """Why ``model.resize_token_embeddings`` cannot run now, or None (torch's and transformers' own, or
    zero3.Init's refusal while it builds: init.py)."""
    if building():
        return None
    modules = (model.get_input_embeddings(), model.get_output_embeddings())
    params = [w for m in modules if m is not None and isinstance(w := getattr(m, "weight", None), ZeroParameter)]
    for p in params:
        z = p._zero
        if getattr(z.ctx, "module", None) is not None:  # initialized, after remove_hooks too (gathered.py refuses it)
            return ZeroStateError(
                f"resize_token_embeddings after zero3.initialize ({z.name}): the optimizer state, buffers and plans "
                "have the old size, and transformers would have changed config.vocab_size and the output embedding "
                f"before zero3 refused the new shape. Resize {WHERE}; nothing was changed")
        if z.status is ParamStatus.NOT_AVAILABLE:
            return ZeroStateError(f"resize_token_embeddings while {z.name} is partitioned: transformers reads and "
                                  f"copies the embeddings. Resize {WHERE}; nothing was changed")
        if not any(c.modifier_rank is not None and any(q is p for q in c.params) for c in OPEN):
            return ZeroStateError(
                f"resize_token_embeddings inside GatheredParameters without modifier_rank ({z.name}): its changes "
                "are discarded, the new shape too, after transformers would have changed config.vocab_size and the "
                f"output embedding. Resize {WHERE}; nothing was changed")
    return None
