"""`GatheredParameters`: gather partitioned parameters for user code, and publish what it changed;
external parameters (`register_external_parameter`).

[Note: writes that GatheredParameters discards]
Without ``modifier_rank`` a ``GatheredParameters`` context is for reading: on exit the gathered
values are dropped and the shards keep theirs (DeepSpeed's meaning). Code that writes there (a
re-initialisation, a weight edit) used to lose the change without a word. So the context takes a
fingerprint of each parameter it gathered itself (one integer sum of the data's bit patterns) on
entry and again on a clean exit; a parameter whose fingerprint changed raises `ZeroStateError`
after everything is released, naming it and ``modifier_rank``. The sum is blind to a permutation
of whole 64-bit words (a row swap, a flip): a position-weighted sum sees it, but cost 14 times the
plain one's time (3.3 against 0.24 ms per 16 MB, measured), paid twice per context by every read of
a whole model (an EMA update each step). Parameters that were gathered
before (persistent ones, those of a running module) are not checked: other code may rewrite them.
A change published by a ``modifier_rank`` context nested inside is not a discarded write (a count
of publishes per parameter tells). The cost is two reads of the gathered data per context.
A change within rounding raises nothing (`_own_slice`): TRL syncs LoRA weights to vLLM inside a
context without ``modifier_rank`` by merging the adapter into the weights, reading them, and
unmerging it, which leaves W + BA - BA, off W in the last bits (3.7e-9 in fp32; probe 28B), and
relies on DeepSpeed discarding that. Where the fingerprint changed, each rank compares its own slice
of the gathered data with its shard (the value at entry, exactly): a change of some element by more
than `ROUNDING_EPS` epsilons of the slice's largest magnitude is a write. The ranks agree on the
verdict (`_agree_written`: one small all-reduce at every exit, so every rank raises or none does),
sending their fingerprints and any new shape too: a rank sees only its own slice, so a change outside
it counts as rounding only when every rank holds the same copy and a fingerprint (a change made on
some ranks only is a write, whatever its size); a change by rounding only is discarded with a
one-time WARNING. In bf16 that tolerance is 1.6% of the largest weight, so a small edit there (a
weight decay by hand) is taken for rounding: the WARNING names it. A shard on the drive cannot be
compared, so any change there raises.

[Note: a new shape before initialize]
Hugging Face's ``resize_token_embeddings`` gives the input embedding's parameter new data of another
shape (``weight.data = new.weight.data``) and replaces an untied output embedding by a new module.
When ``GatheredParameters(..., modifier_rank=...)`` publishes a gathered parameter whose data now has
another shape, the parameter is partitioned anew with it (`ShardStore.repartition`: new shape,
element counts and shard), every rank alike (the modifier rank's values
are broadcast first, as for any change). That is only possible while no engine holds the parameter:
after ``zero3.initialize`` its optimizer state, flat buffers and plans have the old size, so there the
change is refused and the parameter gets its own shape back: the shards are untouched, and its
gathered copy is filled from them again when next gathered (one another context or a running module
still holds keeps uninitialised values until then, and that context's exit reports the change).
Inside the `Init` block that builds the model, the embedding's data becomes the data of the new
embedding's (partitioned) parameter, whose values live in that other parameter's shards: refused
when the block writes the touched parameters back, naming the way that works (after the block,
inside ``GatheredParameters`` over the embeddings, before ``initialize``).

[Note: a loss term from GatheredParameters]
A regulariser built inside the context (``0.1 * w.pow(2).sum()`` on a weight the guard refused
outside it) is often backpropagated after the exit, with the step's loss. ``pow`` saved ``w`` for its
backward, and the exit (or the release after ``w``'s module's backward, when the running step held
it) freed that storage: the backward read freed memory, a segfault on every rank. No module hook
gathers ``w`` again for an op outside any module. So a context entered inside a running step (after
the model's forward) with gradients on keeps the parameters it holds that could be released
gathered until that step ends (its backward's end), as a module's are while its backward may need
them. A context entered between steps (a forward run inside it opens the step) releases them on
exit as before: an evaluation inside it would otherwise hold them until a backward that may never
come. A term whose backward runs after the release gets its saved weight gathered again
(saved_params.py [Note: a saved parameter outlives its gather]).

[Note: a modifier block that raised]
A ``modifier_rank`` block that raises (a checkpoint read failing on rank 0 halfway) publishes
nothing: a half-written tensor is not broadcast (DeepSpeed broadcasts it anyway). Every rank must
decide alike, or the others' broadcast meets no peer (a divergence error naming nothing) and the
ranks' gathered copies differ. So the exit of such a block agrees first which ranks raised (one
small all-reduce of a flag per rank; a new shape refused after initialize counts as raising, so
the ranks that did not make it do not broadcast alone). If any did, every rank discards: the
parameters it releases drop their values, and those that stay gathered (persistent ones, small by
definition, whose gathered copy is the shard itself at world size 1, and those a running module or
an outer block holds) get back the values they had at entry, copied then. Nothing else is copied:
a weight sync inside ``generation()`` releases what the mode kept, so it is never cloned. The ranks
that raised re-raise their error; the others raise `ZeroStateError` naming them. An exception from
the group itself (a divergence, a timeout) skips the agreement, which could not complete; the block
still lets go of its parameters.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Iterable

import torch
from torch import nn

from ..comm.communicator import Kind, Tag
from ..errors import ZeroCommunicationError, ZeroConfigError, ZeroDivergenceError, ZeroStateError
from ..partition.param import PartitionedParameter, ZeroParameter, raw_data
from ..partition.state import MEMORY, ParamStatus
from .context import RuntimeContext
from .handed_copies import OPEN, HandedCopy, take_copies
from .publish import into_shards, published, refuse_reshape, reshaped_ids
from .hf_resize import route_resize
from .parametrize_routes import route_parametrizations
from .rank_values import bit_sum, take_rank0_where_ranks_differ
from .saved_params import SavedParams

logger = logging.getLogger(__name__)

class _EveryRank:
    __slots__ = ()

    def __repr__(self) -> str:
        return "LOCAL_MODIFIER"


LOCAL_MODIFIER: Any = _EveryRank()
"""``modifier_rank`` meaning: every rank made the same change (`Init` building); re-partition, broadcasting
only what differs between ranks from rank 0 (rank_values.py). An object of its own, not an int: a user's
``modifier_rank=-1`` ("the last rank" in Python) must be refused, not taken for it."""


class GatheredParameters:
    """Gather partitioned parameters for reading, or for modifying them on one rank.

    A collective: every rank of the parameters' group must enter it with the same parameters.
    With ``modifier_rank=r``, rank r may change the full tensors; on exit they are broadcast from r
    and re-partitioned on every rank (this is how pretrained weights are loaded into a partitioned
    model; a parameter whose values did not change keeps its shard and fp32 master bit for bit); if
    any rank leaves it with an exception, nothing is published on any rank ([Note: a modifier block
    that raised]).
    With ``modifier_rank=None`` changes are discarded. The values are exact even under qwZ
    (``zero_quantized_weights`` codes forward and backward's gathers only), unless a running module
    holds the parameter: then they are what that module computes with. Parameters already gathered
    (by a running module, or persistent ones) stay gathered on exit. ``fwd_module``: the parameters are
    registered as external parameters of that module (its forward uses them), as in DeepSpeed.
    """

    def __init__(self, params: Iterable[nn.Parameter] | nn.Parameter, modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        if isinstance(params, (nn.Module, str, bytes)) or params is None or not hasattr(params, "__iter__"):
            raise TypeError(f"GatheredParameters takes parameters (model.parameters(), a list of them, or one), got "
                            f"{type(params).__name__}" + (": pass model.parameters()" if isinstance(params, nn.Module)
                                                          else ""))
        if not (modifier_rank is None or modifier_rank is LOCAL_MODIFIER
                or (isinstance(modifier_rank, int) and not isinstance(modifier_rank, bool))):
            raise TypeError(f"GatheredParameters(modifier_rank=...) must be None or a rank (an int >= 0), got "
                            f"{modifier_rank!r}")
        if isinstance(modifier_rank, int) and modifier_rank < 0:
            raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}): a rank of the parameters' group "
                             "(0 to its size - 1), or None to read only; a negative rank does not count from the end")
        if not isinstance(enabled, bool):
            raise TypeError(f"GatheredParameters(enabled=...) must be True or False, got {enabled!r}")
        seen: dict[int, ZeroParameter] = {}
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"GatheredParameters takes parameters, got a {type(p).__name__} among them")
            if isinstance(p, ZeroParameter):
                seen.setdefault(p._zero.id, p)
        self.params = sorted(seen.values(), key=lambda p: p._zero.id)  # same order on every rank
        self._ids = tuple(p._zero.id for p in self.params)
        self._id_set = frozenset(self._ids)
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        self._read_only: tuple[list[ZeroParameter], torch.Tensor, list[int]] | None = None
        self._entry: list[tuple[ZeroParameter, torch.Tensor]] = []  # [Note: a modifier block that raised]
        self._in_step = False  # entered inside a running step, with gradients on
        self._saved: SavedParams | None = None  # [Note: a saved parameter outlives its gather]
        self._handed: list[HandedCopy] = []  # handed_copies.py
        by_ctx: dict[int, list[ZeroParameter]] = {}
        for p in self.params:
            by_ctx.setdefault(id(p._zero.ctx), []).append(p)
        # Parameters of several models or Init blocks (HF's resize before initialize: the new embedding
        # from an Init block of its own beside the old one): one context per model, entered in the order
        # of their first parameter's ds_id, which is the same on every rank.
        self._parts = [GatheredParameters(ps, modifier_rank, enabled=enabled) for ps in by_ctx.values()] \
            if len(by_ctx) > 1 else None
        self._entered: list[GatheredParameters] | None = None  # the parts entered (several models)
        if fwd_module is not None and self._parts is not None and any(
                ps[0]._zero.ctx.module is not None for ps in by_ctx.values()):
            raise ZeroConfigError(
                "GatheredParameters(fwd_module=...) got parameters of several models, one of them with an engine "
                f"({self.params[0]._zero.name}, ...): a module's forward can use only its own engine's parameters. "
                "Register each model's parameters with a module of that model; nothing was registered")
        if fwd_module is not None:
            if not isinstance(fwd_module, nn.Module):
                raise TypeError(f"GatheredParameters(fwd_module=...) must be an nn.Module, got {type(fwd_module).__name__}")
            for p in self.params if enabled else ():  # DeepSpeed's meaning (not when disabled, as there):
                register_external_parameter(fwd_module, p)  # fwd_module's forward uses them from now on

    def __enter__(self) -> list[ZeroParameter]:
        if not self.enabled:
            return self.params
        if self._parts is not None:
            self._enter_parts(self._parts)
            return self.params
        ctx = self.params[0]._zero.ctx
        if self.modifier_rank is not None and self.modifier_rank is not LOCAL_MODIFIER \
                and self.modifier_rank >= ctx.world_size:
            raise ValueError(f"GatheredParameters(modifier_rank={self.modifier_rank}): the parameters' group has "
                             f"{ctx.world_size} rank(s), 0 to {ctx.world_size - 1}")
        ctx.require_states("GatheredParameters", ("lp_params",) if self.modifier_rank is None else
                           ("lp_params", "hp_params"))
        ctx.refresh_stale_persistent()  # a local setter's stale persistent copies (persistent.py `mark_stale`)
        route_resize()  # HF's resize_token_embeddings, refused before it changes anything where it cannot work
        if self.modifier_rank is not None:
            route_parametrizations()  # a parametrization made in the block gets originals of its own memory
        fresh = [p for p in self.params if p._zero.status is ParamStatus.NOT_AVAILABLE]
        kept = [p for p in self.params if p._zero.status is not ParamStatus.NOT_AVAILABLE and p._zero.pinned] \
            if self.modifier_rank is not None and self.modifier_rank is not LOCAL_MODIFIER else []
        self._in_step = torch.is_grad_enabled() and ctx.coordinator.in_step
        try:
            ctx.gather_for_user(self.params)
        except BaseException:  # nothing entered: undo its pins (review 30Z4: a pin left by a divergence kept the
            ctx.coordinator.release_for_user(self.params)  # parameter out of every later gather on this rank)
            raise
        self._entry = [(p, raw_data(p).clone()) for p in kept]  # [Note: a modifier block that raised]
        if self.modifier_rank is None and fresh:  # [Note: writes that GatheredParameters discards]
            self._read_only = (fresh, _fingerprints(fresh), [published.get(p._zero.id, 0) for p in fresh])
        if self.modifier_rank is not LOCAL_MODIFIER and SavedParams.available() \
                and not all(p._zero.persistent for p in self.params):  # not Init's own blocks, while building
            self._saved = SavedParams(ctx, self.params)
            self._saved.__enter__()
        if self.modifier_rank is not LOCAL_MODIFIER:
            OPEN.append(self)  # handed_copies.py
        return self.params

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        if self._entered is not None:
            self._exit_parts(exc_type, exc, tb)
            return
        written: list[ZeroParameter] = []
        ctx = self.params[0]._zero.ctx
        if self in OPEN:
            OPEN.remove(self)
        handed, self._handed = self._handed, []
        if self._saved is not None:
            self._saved.__exit__(exc_type, exc, tb)
            self._saved = None
        modifier = self.modifier_rank is not None
        entry, self._entry = self._entry, []
        refused = take_copies(handed, self.modifier_rank, exc is None)
        if refused is None and modifier and exc is None:
            refused = self._refused_reshape(ctx)
        raised: list[int] = []
        try:
            try:
                raised = self._agree(ctx, exc if exc is not None else refused)
            except BaseException:
                self._discard(ctx, entry, exc_type)  # this rank alone: the group failed
                raise
            if self._in_step and ctx.coordinator.in_step and not (modifier and raised):  # [Note: a loss term from
                ctx.coordinator.keep_for_step(  # GatheredParameters]; not the partial writes of a block that raised
                    [p for p in self.params if p.requires_grad and not p._zero.persistent])
            if modifier and not raised:
                self._publish()
            else:
                refresh = False
                if not modifier:  # before the discard, which may raise on this rank alone (a new shape), when
                    written, refresh = self._agree_written(ctx, exc)  # the others wait in the agreement
                self._discard(ctx, entry, exc_type, refresh)
        finally:
            self._read_only = None
            ctx.coordinator.release_for_user(self.params)
        if refused is not None:
            raise refused
        if raised and exc is None:
            raise ZeroStateError(
                f"GatheredParameters(modifier_rank={self.modifier_rank}): rank(s) {', '.join(map(str, raised))} left "
                "the block with an exception or a refused change, so its change was discarded on every rank (this "
                "one's too: the parameters keep the values they had before the block); the error is raised there")
        if written and exc is None:  # a block that raised: its own exception (probe 28F)
            names = ", ".join(p._zero.name for p in written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
            raise ZeroStateError(
                f"GatheredParameters without modifier_rank: {names} changed inside the context, and zero3 discards "
                "changes made there (as DeepSpeed does: its shards keep their values). Pass modifier_rank=0 to keep "
                "them (rank 0's values then go to every rank)")

    def holds(self, p: ZeroParameter) -> bool:
        """Whether ``p`` is one of this context's parameters."""
        return p._zero.id in self._id_set and p._zero.ctx is self.params[0]._zero.ctx

    def _agree_written(self, ctx: RuntimeContext, exc: BaseException | None) -> tuple[list[ZeroParameter], bool]:
        """A read-only context's exit: (the parameters that some rank wrote beyond rounding in its own slice
        of one the context gathered, or gave data of a new shape, even with the same values; whether a
        persistent one got a new shape, so that every rank gathers the persistent ones again), agreed by
        every rank in one small all-reduce (a rank that raised inside adds none), so that all of them
        raise or none does, and all of them refresh: a rank that found nothing went on alone, and hung in
        its next collective (reviews 28Y, 28Z1, 28Z3, 28Z4). [Note: writes that GatheredParameters discards]"""
        prints: dict[int, int] = {}
        seen: dict[int, str] = {}
        if exc is None and self._read_only is not None:
            seen, after = _written(*self._read_only)
            prints = {id(p): int(f) for p, f in zip(self._read_only[0], after.tolist())}
        fresh = {id(p) for p in self._read_only[0]} if self._read_only is not None else set()
        written = [int(seen.get(id(p)) == "beyond") for p in self.params]
        reshaped = [int(raw_data(p).shape != p._zero.shape) for p in self.params]
        if ctx.world_size > 1 and not isinstance(exc, (ZeroCommunicationError, ZeroDivergenceError)):
            # With each fingerprint (and its negation, for the minimum; the lowest int64, which a maximum
            # ignores, where a rank has none: it raised inside, or the parameter was gathered before):
            # copies that differ between ranks mean a write some ranks made, maybe to others' slices only,
            # which no slice comparison sees (probe 28F). A change outside a rank's own slice ("same" there)
            # is covered by the others' slices only when every rank has the same copy and a fingerprint:
            # else it counts as a write (review 28Z5).
            n = len(self.params)
            mine = [prints.get(id(p)) for p in self.params]
            flags = torch.tensor(written + reshaped + [int(seen.get(id(p)) == "same") for p in self.params] +
                                 [int(id(p) in fresh and id(p) not in prints) for p in self.params] +
                                 [_LOWEST if f is None else f for f in mine] +
                                 [_LOWEST if f is None else (-f if f > _LOWEST else -(_LOWEST + 1)) for f in mine],
                                 dtype=torch.int64)
            ctx.comm.all_reduce(flags, Tag(Kind.ALL_REDUCE, "GatheredParameters exit: writes", self._ids), op="max")
            a = flags.tolist()
            written = [int(a[i] or (a[4 * n + i] != _LOWEST and a[4 * n + i] != -a[5 * n + i])
                           or (a[2 * n + i] and a[3 * n + i])) for i in range(n)]
            reshaped = a[n:2 * n]
        beyond = [p for p, w, r in zip(self.params, written, reshaped) if w or r]
        if not beyond and not _ROUNDING_SAID and any(v in ("rounding", "same") for v in seen.values()):
            _ROUNDING_SAID.append(True)
            logger.warning("zero3: GatheredParameters without modifier_rank: %s changed inside the context by "
                           "rounding only (at most %d machine epsilons of its largest value, as merging and "
                           "unmerging an adapter leaves); discarded, as DeepSpeed discards it. Pass modifier_rank=0 "
                           "if it was meant to stay (said once)",
                           next(p for p in self.params if id(p) in seen)._zero.name, ROUNDING_EPS)
        return beyond, any(r and p._zero.persistent and not p._zero.aliased for p, r in zip(self.params, reshaped))

    def _refused_reshape(self, ctx: RuntimeContext) -> ZeroStateError | None:
        """A new shape after ``zero3.initialize`` (refused): the error, with the parameters given their own
        shape back, nothing gathered (the discard that follows restores the values of those kept)."""
        reshaped = reshaped_ids(self.params)
        if not reshaped or ctx.module is None:
            return None
        try:
            refuse_reshape(ctx, [p for p in self.params if p._zero.id in reshaped],
                           "GatheredParameters(modifier_rank=...)", refresh=False)
        except ZeroStateError as error:  # it always raises when asked to
            return error
        return None

    def _discard(self, ctx: RuntimeContext, entry: list[tuple[ZeroParameter, torch.Tensor]], exc_type: Any,
                 refresh: bool = False) -> None:
        """Nothing is published: a parameter given another shape gets its own back, and those that stay
        gathered get their values from entry back. ``refresh``: some rank gave a persistent parameter a
        new shape (agreed by `_agree_written`), so every rank gathers the persistent ones again (the
        one reshaped here held no values)."""
        modifier = self.modifier_rank is not None
        reshaped = [p for p in self.params if raw_data(p).shape != p._zero.shape]
        error: ZeroStateError | None = None
        try:
            if reshaped:  # discarded as any write, but the parameter must keep its own shape
                refuse_reshape(ctx, reshaped, "GatheredParameters without modifier_rank",
                               raise_=exc_type is None and not modifier, refresh=False)
        except ZeroStateError as exc:
            error = exc
        if refresh:  # a collective: every rank, by the agreement
            ctx.coordinator.refresh_persistent()
        for p, value in entry:
            raw_data(p).copy_(value)
        if error is not None:
            raise error

    def _agree(self, ctx: RuntimeContext, exc: BaseException | None) -> list[int]:
        """The ranks that left a ``modifier_rank`` block with an error, agreed by every rank (one small
        all-reduce) so that all of them publish or none does ([Note: a modifier block that raised]).
        Without a modifier rank (nothing is published), or after a failure of the group itself, this
        rank's own outcome."""
        if self.modifier_rank is None or self.modifier_rank is LOCAL_MODIFIER or ctx.world_size == 1 \
                or isinstance(exc, (ZeroCommunicationError, ZeroDivergenceError)):
            return [ctx.rank] if exc is not None else []
        flags = torch.zeros(2 * ctx.world_size, dtype=torch.int64)  # each rank's error, then its modifier_rank
        flags[ctx.rank], flags[ctx.world_size + ctx.rank] = int(exc is not None), self.modifier_rank
        ctx.comm.all_reduce(flags, Tag(Kind.ALL_REDUCE, f"GatheredParameters(modifier_rank={self.modifier_rank}) "
                                       "exit", self._ids), op="max")
        modifiers = flags[ctx.world_size:].tolist()
        if len(set(modifiers)) > 1:  # probe 35F: each rank broadcast from its own, and all of them waited
            raise ZeroConfigError("GatheredParameters(modifier_rank=...) differs between ranks (" + ", ".join(
                f"rank {ctx.comm.global_rank(r)}: {m}" for r, m in enumerate(modifiers)) + "); give every rank the "
                "same one (a rank of the parameters' group), the rank "
                "whose values go to all; nothing was written")
        return [r for r, f in enumerate(flags[:ctx.world_size].tolist()) if f]

    def _enter_parts(self, parts: list["GatheredParameters"]) -> None:
        """Several models' parameters: enter one context per model, in order (a failure leaves none entered)."""
        entered: list[GatheredParameters] = []
        try:
            for part in parts:
                part.__enter__()
                entered.append(part)
        except BaseException:
            for part in reversed(entered):
                part.__exit__(*sys.exc_info())
            raise
        self._entered = entered

    def _exit_parts(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leave every model's context (each releases what it gathered), in reverse order. A new shape
        refused in one model publishes none of them, as with one model; every model's discarded writes
        are reported together."""
        entered, self._entered = self._entered or [], None
        refused: ZeroStateError | None = None
        if exc_type is None and self.modifier_rank is not None:
            try:
                for part in entered:
                    ctx = part.params[0]._zero.ctx
                    reshaped = reshaped_ids(part.params)
                    bad = [p for p in part.params if p._zero.id in reshaped]
                    if bad and ctx.module is not None:  # no collective here: the parts agree on it
                        refuse_reshape(ctx, bad, "GatheredParameters(modifier_rank=...)", refresh=False)
            except ZeroStateError as error:
                refused = error
                exc_type, exc, tb = type(error), error, error.__traceback__
        errors: list[BaseException] = []
        for part in reversed(entered):
            try:
                part.__exit__(exc_type, exc, tb)
            except Exception as error:  # noqa: BLE001 - reported after every part let go of its parameters
                errors.append(error)
        if refused is not None:
            raise refused
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ZeroStateError(" | ".join(str(e) for e in errors)) from errors[0]

    def _publish(self) -> None:
        ctx = self.params[0]._zero.ctx
        reshaped = reshaped_ids(self.params)
        if reshaped and ctx.module is not None:
            refuse_reshape(ctx, [p for p in self.params if p._zero.id in reshaped], "GatheredParameters(modifier_rank=...)")
        ctx.comm.shards_will_change()  # inside a step: peers stop reading shared shards first
        if self.modifier_rank is LOCAL_MODIFIER:  # every rank made the change: rank 0's where theirs differ
            take_rank0_where_ranks_differ(ctx, [(p._zero.name, raw_data(p)) for p in self.params
                                                if p._zero.id not in reshaped])
        elif ctx.world_size > 1:
            flat = torch.cat([raw_data(p).reshape(-1) for p in self.params])
            ctx.comm.broadcast(flat, self.modifier_rank, Tag(Kind.BROADCAST, "GatheredParameters(modifier_rank="
                                                           f"{self.modifier_rank})", self._ids))
            off = 0
            for p in self.params:
                data = raw_data(p)  # a `p.data = t` of a non-contiguous t: copied through its strides
                n = data.numel()
                data.copy_(flat[off: off + n].view(data.shape))
                off += n
        into_shards(ctx, self.params, reshaped)


def _fingerprints(params: list[ZeroParameter]) -> torch.Tensor:
    """Each parameter's `bit_sum` (exact, and equal only for equal data in practice); read once at entry
    and once at exit ([Note: writes that GatheredParameters discards]). One copy to the host for all of
    them (one synchronisation on CUDA)."""
    sums = [bit_sum(raw_data(p)) for p in params]
    if len({s.device for s in sums}) == 1:
        return torch.stack(sums).cpu()
    return torch.stack([s.cpu() for s in sums])


def _written(params: list[ZeroParameter], before: torch.Tensor,
             counts: list[int]) -> tuple[dict[int, str], torch.Tensor]:
    """The parameters of ``params`` whose data changed since `_fingerprints` took ``before``, not by a
    publish, by id, each with what this rank's slice shows (`_own_slice`); and the fingerprints now
    ([Note: writes that GatheredParameters discards])."""
    after = _fingerprints(params)
    return {id(p): _own_slice(p) for i, p in enumerate(params)
            if after[i] != before[i] and published.get(p._zero.id, 0) == counts[i]}, after


ROUNDING_EPS = 2
"""A change of every element of this rank's slice by at most this many machine epsilons of the slice's
largest magnitude is rounding (a merge and unmerge of a LoRA delta up to the weights' largest size)."""
_LOWEST = -(2**63)  # int64's lowest: no fingerprint, in the agreement's maximum
_ROUNDING_SAID: list[bool] = []  # the WARNING that a change by rounding was discarded: once per process


@torch.no_grad()
def _own_slice(p: ZeroParameter) -> str:
    """How this rank's slice of ``p``'s gathered data differs from its shard (what the parameter held
    at entry): "same" (none of it, or none held here: the change is outside it), "rounding" (at most
    `ROUNDING_EPS` epsilons of the slice's largest value), or "beyond". A shard out of memory (on the
    drive) cannot tell, and data of another dtype (``p.data = t.half()``) is a write: "beyond"."""
    z = p._zero
    data = raw_data(p)
    if z.residence not in MEMORY or data.dtype != z.shard.dtype or data.numel() != z.numel:
        return "beyond"
    start, end = z.shard_range()
    n = max(end - start, 0)
    mine = data.reshape(-1)[start:start + n]
    kept = z.shard[:n].to(mine.device)
    if not n or torch.equal(mine, kept):
        return "same"
    tolerance = ROUNDING_EPS * torch.finfo(data.dtype).eps * kept.float().abs().max()
    return "rounding" if bool((mine.float() - kept.float()).abs().max() <= tolerance) else "beyond"  # NaN: beyond


def refuse_partitioned_load(module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict[str, Any],
                            *_: Any, root: bool = False) -> None:
    """A ``load_state_dict`` pre-hook on every module of an engine's model, acting where the load
    starts (``prefix`` "") and at the model's ``root`` whatever the prefix (a wrapper made after
    ``initialize``, ``torch.compile``'s ``_orig_mod``: review 36R2): torch's copy into a partitioned
    parameter is refused parameter by parameter and collected while the rest loads (probe 36H: with
    the biases persistent, they took the file's values into their shards and masters while the
    weights refused, a half-loaded model). So every key that names a partitioned parameter (also
    without torch's ``checkpoint_wrapper`` part, which its own pre-hook adds later) is refused here,
    before anything below loads. A pre-hook that renames keys, registered after ``initialize``, runs
    after this one."""
    if prefix and not root:
        return
    if local_metadata.get("assign_to_params_buffers", False):  # every zero3 parameter, refused as such
        return refuse_assign(module, state_dict, prefix, local_metadata, whole=True)
    hit = [key for n, p in module.named_parameters(remove_duplicate=False)
           if isinstance(p, PartitionedParameter) and (key := _given_key(state_dict, prefix, n)) is not None]
    if hit:
        raise ZeroStateError(
            f"load_state_dict: {', '.join(hit[:3])}{f' and {len(hit) - 3} more' if len(hit) > 3 else ''} of "
            f"{type(module).__name__} are partitioned (each rank holds a shard), so torch cannot copy into them; "
            "nothing was loaded. zero3.pretrained.load_state_dict(model, state_dict) loads every parameter "
            "into the shards (or load inside `with zero3.GatheredParameters(model.parameters(), modifier_rank=0):`)")


_WRAPPED = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper: in parameter names, not in state dict keys


def _given_key(state_dict: Any, prefix: str, name: str) -> str | None:
    """The key of parameter ``name`` in ``state_dict`` as given: its own, or without checkpoint_wrapper's part."""
    return next((k for k in (prefix + name, prefix + name.replace(_WRAPPED, "")) if k in state_dict), None)


def load_hooks(ctx: RuntimeContext, module: nn.Module) -> list[Any]:
    """The handles of ``module.load_state_dict``'s hooks on a module holding zero3 parameters:
    `refuse_assign` and `keep_finer` before torch loads, `write_back_loaded` after (with the values
    `keep_finer` kept)."""
    finer: dict[int, torch.Tensor] = {}
    return [module.register_load_state_dict_pre_hook(refuse_assign),
            module.register_load_state_dict_pre_hook(functools.partial(keep_finer, finer=finer)),
            module.register_load_state_dict_post_hook(functools.partial(write_back_loaded, ctx, finer=finer))]


def refuse_assign(module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict[str, Any], *_: Any,
                  whole: bool = False) -> None:
    """``load_state_dict(..., assign=True)``: torch would put the loaded tensors in place of zero3's
    parameters (the engine then finds parameters it never partitioned). Refused before this module
    (``whole``: or any below it) loads anything; without ``assign`` the loaded values go into the shards."""
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    named = module.named_parameters(remove_duplicate=False) if whole else dict.items(module._parameters)
    hit = [n for n, p in named if isinstance(p, ZeroParameter) and _given_key(state_dict, prefix, n) is not None]
    if hit:
        raise ZeroStateError(
            f"load_state_dict(..., assign=True) would replace zero3's parameter {prefix + hit[0]} with the loaded "
            "tensor, which zero3 never partitioned. Load without assign (persistent parameters take the values; "
            "for every parameter, zero3.pretrained.load_state_dict(model, state_dict) writes them into the "
            f"shards); {type(module).__name__}'s parameters were left as they were")


def keep_finer(module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict[str, Any], *_: Any,
               finer: dict[int, torch.Tensor]) -> None:
    """Into ``finer`` (by ``ZeroParam.id``), the loaded values finer than their zero3 parameters (fp32
    for a bf16 one): torch copies them rounded, and `write_back_loaded` gives them to the masters."""
    finer.clear()
    for n, p in dict.items(module._parameters):
        value = state_dict.get(prefix + n) if isinstance(p, ZeroParameter) else None
        if isinstance(value, torch.Tensor) and value.is_floating_point() and p._zero.dtype.is_floating_point and \
                value.dtype.itemsize > p._zero.dtype.itemsize and tuple(value.shape) == tuple(p._zero.shape):
            finer[p._zero.id] = value


def write_back_loaded(ctx: RuntimeContext, module: nn.Module, incompatible_keys: Any,
                      finer: dict[int, torch.Tensor] | None = None) -> None:
    """``module.load_state_dict`` post-hook: torch copied the loaded values into the full data of the
    gathered parameters (persistent ones, or held by ``GatheredParameters``), which the next refresh
    from the shards would overwrite; write them into the shards, and into the masters the values in
    ``finer`` where the pre-hook kept them (else the shards': a bf16 master from an fp32 file was
    6e-3 off the file, probe 31H). Every rank loads the same state dict, so every rank keeps its slice
    (partitioned parameters refuse the copy: ``zero3.pretrained.load_state_dict`` loads those)."""
    params = [p for p in dict.values(module._parameters) if isinstance(p, ZeroParameter)
              and p._zero.ctx is ctx and p._zero.status is ParamStatus.AVAILABLE]
    values = dict(finer or {})
    if finer is not None:
        finer.clear()  # the tensors are the caller's: not kept past its load
    if params:
        ctx.comm.shards_will_change()
        into_shards(ctx, params, finer=values)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns.

    zero3 then gathers it with ``module`` (forward and backward). Accesses through another module's
    attribute (``self.wte.weight``) inside a forward are detected automatically once the engine is
    initialised; this call makes it explicit and works for any access path.

    After ``zero3.initialize`` the engine's hooks are told (hooks.py `external_added`): a module that
    had none (no parameters of its own) gets them.

    Raises:
        ZeroStateError: after ``zero3.initialize``, ``module`` is not part of the engine's model.
    """
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter expects an nn.Parameter, got {type(parameter).__name__}")
    ext = module.__dict__.setdefault("_external_params", {})
    ext[id(parameter)] = parameter
    ctx = parameter._zero.ctx if isinstance(parameter, ZeroParameter) else None
    if ctx is not None and ctx.external_added is not None:
        try:
            ctx.external_added(module)
        except ZeroStateError:
            del ext[id(parameter)]
            raise


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list(module.__dict__.get("_external_params", {}).values())
