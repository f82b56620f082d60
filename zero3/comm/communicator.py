"""The communicator: every collective zero3 issues goes through one `Communicator`.

Parameter gathers, gradient reductions, broadcasts, all-reduces, gathers to rank 0, object exchanges
and step agreements all pass here, so verification, metrics, profiler labels, timeouts and test
doubles live in one place, and the torch-version shims exist once. Each call names what it moves
with a `Tag` (its kind, a label for messages, the parameter ids it carries). No other module of
zero3 calls ``torch.distributed`` collectives (tests/unit/test_structure.py reads the source).

How collectives are verified without a round trip each, and what happens when ranks diverge or
one stops taking part: [Note: verified collectives] in comm_verify.py.

[Note: streams and buffer lifetime]
On CUDA with ``overlap_comm``, copy-in, all-gather and copy-out run on one side stream, and an
event recorded there is what the compute stream waits on before the module runs. No
``record_stream``: before the side stream allocates anything it waits for the compute stream
(``side.wait_stream(compute)``), so a block freed by a release on the compute stream is never reused
by the side stream while compute kernels may still read it. Memory is therefore deterministic. On
CPU the collective is issued with ``async_op=True`` and waited in `GatherWork.wait`, just before use.
"""

from __future__ import annotations

import datetime
import enum
import logging
import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .verify import (
    HEADER_BYTES,
    LEAVING,
    VOIDED,
    WINDOW,
    WIRE_WORDS,
    EpochMode,
    FailureReport,
    PayloadHeader,
    PlanCache,
    Slot,
    WireHeader,
    bitcast_elements,
    content_hash,
    header_as,
    header_values,
    headers_from,
    headers_from_values,
)
from ..errors import ZeroCommunicationError, ZeroConfigError, ZeroDivergenceError, ZeroStateError
from ..metrics import VERIFICATION, StepMetrics
from . import codec as quantize
from ..partition import sharding
from ..partition.param import ZeroParameter, alloc_full, raw_data
from ..partition.views import byte_view
from .topology import node_identity, node_ids

logger = logging.getLogger(__name__)


# torch 2.13 renamed the flat collectives; keep working on the older names (torch >= 2.4). Looked up at
# each call, so a test can wrap torch.distributed's functions to count bytes independently.
def _all_gather_flat(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_flat(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


HEADER_VALUES = 16  # a PayloadHeader as small integers (the reduction form)


def group_info(group: Any) -> tuple[Any, int, int]:
    """(group, world_size, rank) for a process group, the default group, or no distributed at all."""
    if dist.is_available() and dist.is_initialized():
        g = group if group is not None else dist.group.WORLD
        return g, dist.get_world_size(g), dist.get_rank(g)
    if group is not None:
        raise ZeroConfigError("a process group was given but torch.distributed is not initialized")
    return None, 1, 0


def same_group(a: Any, b: Any) -> bool:
    """Whether two process groups hold the same ranks (None is the default group)."""
    if a is b or not (dist.is_available() and dist.is_initialized()):
        return True
    ga = a if a is not None else dist.group.WORLD
    gb = b if b is not None else dist.group.WORLD
    return dist.get_process_group_ranks(ga) == dist.get_process_group_ranks(gb)


_META = torch.device("meta")


class Kind(enum.Enum):
    """What a collective is for; part of every verification header."""

    PARAM_GATHER = "all-gather"
    SECONDARY_GATHER = "secondary all-gather"  # hpZ: from the secondary shards, inside a node group
    GRAD_REDUCE = "gradient reduction"
    ALL_REDUCE = "all-reduce"
    BROADCAST = "broadcast"
    TENSOR_GATHER = "tensor all-gather"
    GATHER_TO_ROOT = "gather to rank 0"
    OBJECTS = "object exchange"
    AGREE = "step agreement"


_KIND_CODES = {k: i + 1 for i, k in enumerate(Kind)}
_HEADER_FIRST = {Kind.BROADCAST, Kind.TENSOR_GATHER, Kind.GATHER_TO_ROOT, Kind.OBJECTS, Kind.AGREE}


@dataclass(frozen=True, slots=True)
class Tag:
    """What a collective moves: its kind, a label for messages (``pre_forward blocks.3``,
    ``clip_grad_norm_``), and the ids of the parameters it carries."""

    kind: Kind
    label: str = ""
    ids: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"{self.kind.value} for {self.label or 'a user request'}"


class Route(enum.Enum):
    PLAIN = enum.auto()  # verification off: just issue it
    PLANNED = enum.auto()  # following the plan: carry a header in the payload
    CHECKED = enum.auto()  # headers agreed in a blocking exchange: issue the data


@dataclass(eq=False)
class _Slot:
    """A planned collective (or a dummy) issued and not yet verified."""

    seq: int
    kind: Kind
    sizes: tuple[int, ...]
    works: list[Any]
    read_headers: Callable[[], list[PayloadHeader | None]]
    void: bool = False


@dataclass(eq=False)
class _Chunk:
    params: list[ZeroParameter]
    offsets: list[int]
    total: int  # sum of shard sizes
    rows: list[torch.Tensor] | None = None  # every rank's piece (its shards, then header room), by rank
    work: Any = None


class _Pairwise:
    """Point-to-point sends and receives standing for one collective (``allgather_impl`` /
    ``reduce_scatter_impl`` "p2p"); ``wait()`` waits for all of them, then runs ``then`` (e.g. summing
    what arrived)."""

    def __init__(self, works: list[Any], then: Any = None) -> None:
        self.works = works
        self.then = then
        self.done = False
        self.keep: list[Any] = []
        self.headers: Any = None

    def wait(self) -> bool:
        if not self.done:
            for w in self.works:
                w.wait()
            self.done = True
            self.keep = []
            if self.then is not None:
                self.then()
        return True


@dataclass(eq=False)
class Secondary:
    """hpZ: what a rank keeps of one parameter from a forward gather until the step ends, its
    secondary slice (`sharding.secondary_range`): in the parameter's dtype, padded; or under qwZ the
    quantized bytes of the N primary shards the slice spans, as they arrived (each shard's values,
    then its scales), so backward computes with the very weights forward did."""

    data: torch.Tensor
    quantized: bool

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(eq=False)
class GatherWork:
    """An issued all-gather of parameter shards. ``wait()`` is idempotent; when it returns, every
    parameter's storage holds its full, verified data (the caller then marks them AVAILABLE), and
    with ``keep_secondary`` ``secondaries`` holds each parameter's hpZ secondary slice."""

    comm: "Communicator"
    params: Sequence[ZeroParameter] = ()
    tag: Tag | None = None
    chunks: list[_Chunk] = field(default_factory=list)
    event: Any = None
    slot: _Slot | None = None
    direct: Any = None  # pairwise messages received straight into the parameters' storage
    quantized: Any = None  # (rows, layout) of a quantized gather, dequantized into storage on wait
    span: int = 1  # primary shards per row piece: N for an hpZ secondary gather, else 1
    keep_secondary: bool = False
    secondaries: dict[int, Secondary] = field(default_factory=dict)  # param record id -> its secondary slice
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        comm = self.comm
        t0 = time.perf_counter()
        if self.slot is not None:
            comm._verify_through(self.slot)
        if self.direct is not None:
            comm._wait_work(self.direct, self.tag)
            if self.slot is not None and self.slot.void:
                assert self.tag is not None
                comm._voided(self.tag, self.slot.sizes)
            if self.quantized is not None:
                comm._dequantize_gather(self.params, *self.quantized, span=self.span)
        elif self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        else:
            for chunk in self.chunks:
                if chunk.work is not None:
                    comm._wait_work(chunk.work, self.tag)
        if self.slot is not None and self.slot.void:  # issued where another rank left the plan
            assert self.tag is not None
            comm._voided(self.tag, self.slot.sizes)
        elif self.event is None:
            for chunk in self.chunks:
                comm._copy_out(chunk)
        if self.keep_secondary:
            self.secondaries = comm._secondaries(self.params, self.quantized)
        comm.metrics.wait_seconds += time.perf_counter() - t0
        self.chunks = []
        self.event = None
        self.quantized = None


@dataclass(frozen=True, slots=True)
class GradPiece:
    """One parameter's full gradient in a reduction (None: zeros). ``counted``: reduce a presence count
    with it (how many ranks had a gradient at all: leaf units, see grad.py)."""

    numel: int
    shard_numel: int
    grad: torch.Tensor | None
    counted: bool = False


@dataclass(eq=False)
class ReduceBuffer:
    """A flat rank-major gradient buffer: fill ``rows`` (``(world, S)``), then `Communicator.reduce`."""

    flat: torch.Tensor  # what goes on the wire (rows, plus header room when verifying)
    rows: torch.Tensor
    shard_numel: int


@dataclass(eq=False)
class ReduceWork:
    """An issued averaging reduction; ``wait()`` returns this rank's ``S`` elements (idempotent)."""

    comm: "Communicator"
    buffer: ReduceBuffer
    out: torch.Tensor
    tag: Tag | None = None
    work: Any = None
    slot: _Slot | None = None
    result: torch.Tensor | None = None
    failed: bool = False

    def wait(self) -> torch.Tensor:
        if self.result is None:
            if self.failed:
                raise ZeroStateError(f"{self.tag.describe() if self.tag else 'a reduction'} failed earlier "
                                     "(see the first error)")
            self.failed = True  # until it succeeds: a failed wait issues nothing the second time
            comm = self.comm
            t0 = time.perf_counter()
            if self.slot is not None:
                comm._verify_through(self.slot)
            elif self.work is not None:
                comm._wait_work(self.work, self.tag)
            if self.slot is not None and self.slot.void:
                assert self.tag is not None
                comm._voided(self.tag, self.slot.sizes)
            comm.metrics.reduce_wait_seconds += time.perf_counter() - t0
            self.result = self.out[: self.buffer.shard_numel].div_(comm.world_size)
            self.buffer = None  # type: ignore[assignment]  # the input may go now
            self.failed = False
        return self.result


class Communicator:
    """Collectives over one process group (``None`` with world size 1: every call is local).

    Args:
        group, world_size, rank: the group and this rank's place in it (`group_info`).
        overlap: issue parameter gathers and reductions asynchronously (side stream on CUDA).
        bucket_numel: largest number of elements one parameter all-gather moves.
        reduce_impl: ``reduce_scatter``, ``all_reduce`` (then slice), ``p2p`` (pairwise sends and
            receives, then a local sum) or ``auto`` (p2p on gloo, reduce-scatter elsewhere).
        allgather_impl: ``all_gather``, ``p2p`` or ``auto`` (p2p on gloo, all-gather elsewhere).
        metrics: the step counters to update.
        verify: verify every collective (comm_verify.py); None: on for gloo, off for NCCL.
        timeout_s: when > 0 and world size > 1, collectives run on a process group of their own
            with this timeout (a rank that stops taking part is reported instead of waited for).
        plans: how many epoch plans to remember.
        quantize_weights: parameter gathers carry blockwise int8 values and a scale per block
            (quantize.py); the gathered weights are dequantized, shards stay exact.
        quantize_gradients: 8 or 4: reduction messages carry blockwise int8/int4 values; each is
            dequantized before it is added, so nothing accumulates; 0: off.
        quant_block: elements per quantization block.
        nodes: the node of every rank of the group (topology.py); None: every rank sends its
            `node_identity` to the others now (a collective: build communicators on every rank).
        dedicated: ``group`` is already zero3's own group with ``timeout_s`` (`hierarchical` makes one).

    Every byte received is counted in ``metrics.recv_bytes`` by kind and by node scope (intra /
    inter): pairwise messages exactly, collectives by the logical bytes each peer contributes.
    """

    def __init__(self, group: Any, *, world_size: int, rank: int, metrics: StepMetrics, overlap: bool = True,
                 bucket_numel: int = 1 << 62, reduce_impl: str = "auto", allgather_impl: str = "auto",
                 verify: bool | None = None, timeout_s: float = 0.0, plans: int = 8,
                 quantize_weights: bool = False, quantize_gradients: int = 0, quant_block: int = 512,
                 nodes: Sequence[int] | None = None, dedicated: bool = False) -> None:
        self.world_size = world_size
        self.rank = rank
        self.overlap = overlap
        self.bucket_numel = max(1, bucket_numel)
        self.metrics = metrics
        distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.backend = dist.get_backend(group) if distributed else "none"
        self.timeout_s = float(timeout_s)
        self.group = group
        if distributed and self.timeout_s > 0 and not dedicated:
            # Our own group: its timeout bounds every wait, and breaking it leaves the user's intact.
            self.group = dist.new_group(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD),
                                        timeout=datetime.timedelta(seconds=self.timeout_s), backend=self.backend,
                                        use_local_synchronization=True)
        if reduce_impl == "auto":  # gloo's collectives were measured ~2x slower than pairwise messages
            reduce_impl = "p2p" if self.backend == "gloo" else "reduce_scatter"
        if allgather_impl == "auto":
            allgather_impl = "p2p" if self.backend == "gloo" else "all_gather"
        self.reduce_impl = reduce_impl
        self.allgather_impl = allgather_impl
        self._p2p_tag = 0
        self.quantize_weights = quantize_weights  # ZeRO++ qwZ: gathers carry int8 blocks plus scales
        self.quantize_gradients = quantize_gradients  # ZeRO++ qgZ: bits of reduction messages (0: off)
        self.quant_block = quant_block
        self.verify = ((self.backend == "gloo") if verify is None else verify) and world_size > 1
        # NCCL moves only CUDA tensors: small tensors (headers, flags) live there.
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        self._side_stream: Any = None
        self.mode = EpochMode.IDLE
        self.epoch = 0
        self._seq = 0
        self._plan: tuple[Slot, ...] = ()
        self._plan_key = 0
        self._log: list[Slot] = []
        self._outstanding: deque[_Slot] = deque()
        self._plans = PlanCache(plans)
        self.report = FailureReport(_group_name(self.group), world_size, rank) if distributed else None
        if nodes is None:
            nodes = node_ids(self._objects(node_identity(), None)) if distributed else (0,) * world_size
        if len(nodes) != world_size:
            raise ZeroConfigError(f"nodes must name the node of each of the {world_size} ranks, got {list(nodes)}")
        self.nodes = tuple(nodes)
        self._scope = tuple("intra" if n == self.nodes[rank] else "inter" for n in self.nodes)
        self.hpz = 1  # ranks per hpZ secondary group (`hierarchical`); 1: no secondary shards
        self.secondary_span = 1  # on a secondary group's communicator: primary shards per secondary slice

    # -- byte accounting ---------------------------------------------------------------------------
    def _count(self, kind: Kind | str, peer: int, nbytes: int, pairwise: bool) -> None:
        """``nbytes`` received from group rank ``peer``: in ``metrics.recv_bytes[kind][scope]``, and in
        ``p2p_recv_bytes`` when it was a pairwise message."""
        key = kind.value if isinstance(kind, Kind) else kind
        counts = self.metrics.recv_bytes.get(key)
        if counts is None:
            counts = self.metrics.recv_bytes[key] = {"intra": 0, "inter": 0}
        counts[self._scope[peer]] += nbytes
        if pairwise:
            self.metrics.p2p_recv_bytes += nbytes

    def _count_peers(self, kind: Kind | str, nbytes: int, header_bytes: int = 0, pairwise: bool = False) -> None:
        """The same ``nbytes`` (plus ``header_bytes`` of verification) from every other rank."""
        for q in range(self.world_size):
            if q != self.rank:
                self._count(kind, q, nbytes, pairwise)
                if header_bytes:
                    self._count(VERIFICATION, q, header_bytes, pairwise)

    def hierarchical(self, size: int) -> "Communicator":
        """hpZ: a communicator over this rank's secondary group, the block of ``size`` consecutive
        group ranks it is in (`topology.hpz_group_size`), sharing this one's settings and metrics.

        Each rank creates only its own block's process group (``use_local_synchronization``), so the
        blocks need no common order; every rank of a block must call this at the same point
        (``zero3.initialize`` does). From now on this communicator's parameter gathers can keep
        secondary slices (``keep_secondary``), which the returned one gathers (`all_gather_secondary`).
        """
        w = self.world_size
        if size < 2 or size >= w or w % size:
            raise ZeroConfigError(f"an hpZ group of {size} ranks needs 1 < size < world size {w} dividing it")
        first = self.rank // size * size
        ranks = [self.global_rank(first + j) for j in range(size)]
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=self.timeout_s)} if self.timeout_s > 0 else {}
        group = dist.new_group(ranks, backend=self.backend, use_local_synchronization=True, **kwargs)
        node = Communicator(group, world_size=size, rank=self.rank - first, metrics=self.metrics,
                            overlap=self.overlap, bucket_numel=self.bucket_numel, reduce_impl=self.reduce_impl,
                            allgather_impl=self.allgather_impl, verify=self.verify, timeout_s=self.timeout_s,
                            plans=self._plans.capacity, quantize_weights=self.quantize_weights,
                            quant_block=self.quant_block, nodes=self.nodes[first: first + size], dedicated=True)
        node.secondary_span = w // size
        self.hpz = size
        return node

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of ``group_rank`` in this communicator's group."""
        if self.group is None or self.world_size == 1:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- epochs and routes (comm_verify.py [Note: verified collectives]) -------------------------
    def end_epoch(self) -> None:
        """The runtime finished an epoch (``engine.step()``, or an inference forward): leave the plan
        if it is not done, remember what this epoch issued, and start counting afresh."""
        if not self.verify or self.mode in (EpochMode.IDLE, EpochMode.BROKEN):
            return
        if self.mode is EpochMode.PLANNED:
            while self._outstanding and self.mode is EpochMode.PLANNED:
                self._verify_next()
            if self.mode is EpochMode.PLANNED and self._seq < len(self._plan):
                self._leave()
        self._drain()
        self._plans.record(self._plan_key, self._log)
        self._reset_epoch()

    def abandon_epoch(self, reason: str | None = None) -> None:
        """The step was aborted (an exception): keep the others from waiting on slots this rank will
        not issue (leave the plan in-band), forget this epoch, and post ``reason`` for the others."""
        if reason is not None and self.report is not None:
            self.report.post(f"{self.epoch}|{reason}")
        if not self.verify or self.mode in (EpochMode.IDLE, EpochMode.BROKEN):
            return
        try:
            if self.mode is EpochMode.PLANNED:
                while self._outstanding and self.mode is EpochMode.PLANNED:
                    self._verify_next()
                if self.mode is EpochMode.PLANNED and self._seq < len(self._plan):
                    self._leave()
            self._drain()
        except ZeroCommunicationError:
            return
        except ZeroDivergenceError:
            pass
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        if self.mode is EpochMode.BROKEN:
            return
        self.epoch += 1
        self.mode = EpochMode.IDLE
        self._seq = 0
        self._plan = ()
        self._log = []
        self._outstanding.clear()

    def _route(self, tag: Tag, slot: Slot) -> Route:
        """Decide how to issue a request; may block (epoch start, window, header exchange)."""
        if not self.verify:
            return Route.PLAIN
        if self.mode is EpochMode.BROKEN:
            raise ZeroCommunicationError(f"{tag.describe()}: zero3's process group is closed after a failed "
                                         "collective (see the first error); restart from the last checkpoint")
        self._log.append(slot)
        if self.mode is EpochMode.IDLE and self._start_epoch(tag, slot):
            return Route.CHECKED
        if self.mode is EpochMode.PLANNED:
            if self._outstanding and (slot.header_first or self._outstanding[0].seq <= self._seq - WINDOW):
                self._flush_window(slot.header_first)
            if self.mode is EpochMode.PLANNED:
                if self._seq < len(self._plan) and self._plan[self._seq] == slot:
                    if not slot.header_first or self._planned_exchange(tag, slot):
                        return Route.PLANNED if not slot.header_first else Route.CHECKED
                else:
                    self._leave()
        self._exchange(tag, slot)
        return Route.CHECKED

    def _planned_exchange(self, tag: Tag, slot: Slot) -> bool:
        """A planned slot that starts with a blocking header exchange: True when every rank is at
        this very slot; else every rank switches right after it (it completed everywhere at once)."""
        mine = WireHeader(self.epoch, self._seq, _KIND_CODES[tag.kind],
                          content_hash(tag.kind.value, tag.ids, slot.sizes), sum(slot.sizes))
        rows = self._wire_exchange(mine, tag)
        self.metrics.header_exchanges += 1
        self._seq += 1
        if all(mine.same_request(r) and r is not None and r.flags == 0 for r in rows):
            return True
        self.metrics.anomalies += 1
        self.mode = EpochMode.CHECKED
        logger.info("zero3: collective plan left at slot %d of step %d; verifying every collective until the "
                    "step ends", self._seq - 1, self.epoch)
        return False

    def _flush_window(self, everything: bool) -> None:
        """Verify the oldest slots: all of them, or those K behind the next sequence number."""
        while self._outstanding and self.mode is EpochMode.PLANNED and \
                (everything or self._outstanding[0].seq <= self._seq - WINDOW):
            self.metrics.forced_verifies += 1
            self._verify_next()

    def _start_epoch(self, tag: Tag, slot: Slot) -> bool:
        """One blocking exchange: this epoch's first request and the plan each rank proposes. Returns
        True when it also verified the request (no common plan: the epoch runs CHECKED)."""
        key = content_hash(tag.kind.value, tag.ids, slot.sizes)
        self._plan_key = key
        choice = self._plans.choose(key)
        digest = choice[1] if choice is not None else 0
        mine = WireHeader(self.epoch, 0, _KIND_CODES[tag.kind], key, sum(slot.sizes), digest)
        rows = self._wire_exchange(mine, tag)
        self.metrics.header_exchanges += 1
        if not all(mine.same_request(r) for r in rows):
            self._diverged(tag, slot, rows)
        if choice is not None and all(r is not None and r.digest == digest for r in rows):
            self.mode = EpochMode.PLANNED
            self._plan = choice[0]
            self._seq = 0
            return False
        self.mode = EpochMode.CHECKED
        self._seq = 1
        return True

    def _exchange(self, tag: Tag, slot: Slot, flags: int = 0) -> None:
        """CHECKED: agree on this request in one blocking header exchange, or raise on every rank."""
        mine = WireHeader(self.epoch, self._seq, _KIND_CODES[tag.kind],
                          content_hash(tag.kind.value, tag.ids, slot.sizes), sum(slot.sizes), flags=flags)
        rows = self._wire_exchange(mine, tag)
        self.metrics.header_exchanges += 1
        if not all(mine.same_request(r) and r is not None and r.flags == 0 for r in rows):
            self._diverged(tag, slot, rows, voided=bool(flags))
        self._seq += 1

    def _voided(self, tag: Tag, sizes: tuple[int, ...]) -> None:
        """A request of this rank was issued in a slot another rank left the plan at: the ranks are
        not doing the same thing. Tell everyone in a header exchange flagged VOIDED: all raise."""
        if self.mode is EpochMode.PLANNED:
            self._leave()
        self._exchange(tag, Slot(tag.kind.value, sizes, "", False), flags=VOIDED)

    def _wire_exchange(self, mine: WireHeader, tag: Tag) -> list[WireHeader | None]:
        out = torch.empty(WIRE_WORDS * self.world_size, dtype=torch.int64, device=self.device)
        t0 = time.perf_counter()
        self._blocking(lambda: _all_gather_flat(out, mine.to_tensor(self.device), group=self.group), tag)
        self.metrics.header_seconds += time.perf_counter() - t0
        self._count_peers(VERIFICATION, WIRE_WORDS * 8)
        return WireHeader.rows(out)

    def _diverged(self, tag: Tag, slot: Slot, rows: list[WireHeader | None], voided: bool = False) -> None:
        """Every rank saw the same mismatching headers: describe and raise on all of them."""
        seq = self._seq
        what = f"{tag.describe()} ({sum(slot.sizes):,} elements"
        if tag.ids:  # ranks may agree on everything but which parameters (they numbered them differently)
            shown = ", ".join(map(str, tag.ids[:6])) + (f", ... ({len(tag.ids)} in all)" if len(tag.ids) > 6 else "")
            what += f"; parameter ds_ids {shown}"
        what += ")"
        if voided:
            what += ", issued where another rank had left the plan"
        details = self._objects((self.epoch, seq, what), VERIFICATION)
        lines = "; ".join(f"rank {r}: step {e} collective #{s} {w}" for r, (e, s, w) in enumerate(details))
        if self.report is not None:
            self.report.post(f"{self.epoch}|raised ZeroDivergenceError at collective #{seq} ({what})")
        self._reset_epoch()
        raise ZeroDivergenceError(
            f"ranks disagree on the next collective ({lines}). zero3 needs every rank to run the same "
            "modules in the same order with the same parameters (SPMD); make skipped branches run on every "
            "rank (e.g. with zero inputs), or make the part whose routing differs a leaf module "
            "(zero3.set_leaf_modules) so it is gathered and reduced as one unit.")

    def _leave(self) -> None:
        """This rank's next request is not the planned slot (or its epoch ends early): verify what is
        in flight, then mark the planned slots from here void in-band and switch to CHECKED."""
        while self._outstanding and self.mode is EpochMode.PLANNED:
            self._verify_next()
        if self.mode is EpochMode.PLANNED:
            self.metrics.plan_departures += 1
            self._switch(self._seq)

    def _switch(self, first: int) -> None:
        """The first anomaly is at slot ``first``: issue every planned slot up to the agreed switch
        point as a void dummy, wait for everything in flight, and go CHECKED."""
        plan = self._plan
        last = first if first < len(plan) and plan[first].header_first else first + WINDOW - 1
        for s in self._outstanding:
            s.void = True
        while self._seq <= min(last, len(plan) - 1):
            self._outstanding.append(self._dummy(plan[self._seq]))
            self._seq += 1
        self._drain()
        self._seq = max(self._seq, min(last, len(plan) - 1) + 1)
        self.mode = EpochMode.CHECKED
        logger.info("zero3: collective plan left at slot %d of step %d; verifying every collective until the "
                    "step ends", first, self.epoch)

    def _drain(self) -> None:
        """Wait for every slot in flight without using it (they are void, or verified already)."""
        while self._outstanding:
            s = self._outstanding.popleft()
            for w in s.works:
                self._wait_work(w, None)

    def _verify_next(self) -> None:
        s = self._outstanding.popleft()
        for w in s.works:
            self._wait_work(w, None)
        headers = s.read_headers()
        first = headers[0]
        ok = first is not None and first.epoch == self.epoch & 0xFFFF and first.seq == s.seq and \
            first.flags == 0 and all(h == first for h in headers)
        if ok and not s.void:
            return
        self.metrics.anomalies += 1
        s.void = True
        if self.mode is EpochMode.PLANNED:
            self._outstanding.appendleft(s)
            self._switch(s.seq)

    def _verify_through(self, slot: _Slot) -> None:
        """Verify, in order, every slot up to and including ``slot``."""
        while self.mode is EpochMode.PLANNED and any(s is slot for s in self._outstanding):
            self._verify_next()
        if any(s is slot for s in self._outstanding):  # drained as void by a switch meanwhile
            self._outstanding.remove(slot)

    def _planned_header(self, kind: Kind, tag_ids: tuple[int, ...], sizes: tuple[int, ...],
                        flags: int = 0) -> PayloadHeader:
        return PayloadHeader(self.epoch & 0xFFFF, self._seq, content_hash(kind.value, tag_ids, sizes), flags)

    def _register(self, kind: Kind, sizes: tuple[int, ...], works: list[Any],
                  reader: Callable[[], list[PayloadHeader | None]]) -> _Slot:
        s = _Slot(self._seq, kind, sizes, works, reader)
        self._outstanding.append(s)
        self._seq += 1
        return s

    # -- waiting, with failures turned into clear errors ------------------------------------------
    def _wait_work(self, work: Any, tag: Tag | None) -> None:
        self._blocking(work.wait, tag)

    def _blocking(self, fn: Callable[[], Any], tag: Tag | None) -> Any:
        try:
            return fn()
        except RuntimeError as exc:
            if self.world_size > 1 and isinstance(exc, RuntimeError) and not isinstance(exc, ZeroStateError):
                self._fail(exc, tag)
            raise

    def _fail(self, exc: BaseException, tag: Tag | None) -> None:
        """A collective did not complete (timeout, or a peer closed its connection)."""
        if self.mode is EpochMode.BROKEN:
            raise ZeroCommunicationError(f"zero3's process group is closed after an earlier failure: {exc}")
        self.mode = EpochMode.BROKEN
        where = f"collective #{self._seq} of step {self.epoch}" + (f" ({tag.describe()})" if tag else "")
        peers: dict[int, str] = {}
        if self.report is not None:
            self.report.post(f"{self.epoch}|timed out or lost its peers while waiting in {where}")
            peers = self.report.read(min(2.0, max(0.2, 0.1 * self.timeout_s)))
        lines = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            epoch, _, msg = peers.get(r, "").partition("|")
            if msg and epoch.isdigit() and int(epoch) >= self.epoch - 1:
                lines.append(f"rank {r} {msg}")
            else:
                lines.append(f"rank {r} reported nothing: it stopped taking part (returned early, is stuck in its "
                             "own code, or died)")
        limit = f"collective_timeout={self.timeout_s:g} s" if self.timeout_s > 0 else "the process group's timeout"
        raise ZeroCommunicationError(
            f"rank {self.rank} waited in {where} and not every rank took part within {limit}: "
            + "; ".join(lines) + f". ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}) zero3's own process "
            "group is closed now; every further collective of this engine raises. The default process group is not "
            "affected, but a rank that died is gone: save what you need and restart from the last checkpoint."
        ) from exc

    # -- parameter all-gather --------------------------------------------------------------------
    def all_gather_params(self, params: Sequence[ZeroParameter], tag: Tag, count: bool = True,
                          keep_secondary: bool = False) -> GatherWork:
        """Issue the all-gather of ``params``' shards into their own storage (split at ``bucket_numel``).

        The caller owns the parameters' status (NOT_AVAILABLE -> INFLIGHT -> AVAILABLE); this only
        moves bytes. Their storage is allocated when the data is copied out. ``count``: add it to
        the step's gather metrics (persistent refreshes are counted apart). ``keep_secondary`` (hpZ,
        after `hierarchical`): the work's ``wait()`` also cuts each parameter's `Secondary` slice.
        """
        handle = GatherWork(comm=self, params=params, tag=tag, keep_secondary=keep_secondary and self.hpz > 1)
        if not params:
            return handle
        numel = sum(p._zero.numel for p in params)
        if count:
            m = self.metrics
            m.allgather_calls += 1
            m.allgather_numel += numel
            m.allgather_bytes += sum(p._zero.nbytes for p in params)
        if self.world_size == 1:  # the "gather" is a copy from the shard (host to device when offloaded)
            device = raw_data(params[0]).device
            if device.type == "cuda" and self.overlap:
                side = self._side(device)
                with torch.cuda.stream(side):
                    for chunk in self._chunks(params):
                        self._copy_out(chunk)
                    handle.event = torch.cuda.Event()
                    handle.event.record(side)
                return handle
            for chunk in self._chunks(params):
                self._copy_out(chunk)
            handle.done = True
            return handle
        if self.quantize_weights and all(p._zero.shard.is_floating_point() for p in params):
            return self._gather_quantized(params, tag, handle)
        # Meta tensors (a model built on the meta device, as from_pretrained does) have no backend for
        # point-to-point messages; the collective path's meta kernels move nothing, as there is nothing.
        if self.allgather_impl == "p2p" and all(p._zero.shard.device == raw_data(p).device != _META and
                                                p._zero.shard.dtype == raw_data(p).dtype for p in params):
            return self._gather_direct(params, tag, handle)
        chunks = self._chunks(params)
        dtype = params[0]._zero.shard.dtype
        hdr = bitcast_elements(dtype) if self.verify else 0
        slot = Slot(Kind.PARAM_GATHER.value, tuple(c.total for c in chunks), str(dtype), False)
        route = self._route(tag, slot)
        header = None
        if route is Route.PLANNED:
            header = self._planned_header(Kind.PARAM_GATHER, tag.ids, slot.sizes)
        device = raw_data(params[0]).device  # where the gathered tensor lives (shards may be on the CPU)
        use_stream = device.type == "cuda" and self.overlap
        if use_stream:
            with torch.cuda.stream(self._side(device)):
                for chunk in chunks:
                    self._issue(chunk, hdr, header, async_op=False)
                    self._copy_out(chunk, keep_header=header is not None)
                handle.event = torch.cuda.Event()
                handle.event.record(self._side_stream)
        else:
            async_op = self.overlap
            for chunk in chunks:
                self._issue(chunk, hdr, header, async_op=async_op)
            handle.chunks = chunks
        if header is not None:
            event = handle.event
            handle.slot = self._register(Kind.PARAM_GATHER, slot.sizes, [c.work for c in chunks if c.work is not None],
                                         lambda: _gather_headers(chunks, self.world_size, hdr, event))
        return handle

    def _gather_direct(self, params: Sequence[ZeroParameter], tag: Tag, handle: GatherWork) -> GatherWork:
        """``allgather_impl="p2p"``: each rank sends its real piece of every parameter to every other
        rank, received straight into the parameter's storage: no copy in, no copy out (the
        [Note: verified collectives] header travels as one more 16-byte message per peer)."""
        dtype = params[0]._zero.shard.dtype
        slot = Slot(Kind.PARAM_GATHER.value, tuple(p._zero.numel for p in params), str(dtype), False)
        route = self._route(tag, slot)
        header = self._planned_header(Kind.PARAM_GATHER, tag.ids, slot.sizes) if route is Route.PLANNED else None
        fulls = []
        for p in params:
            full = alloc_full(p)
            lo, hi = _piece(p._zero.numel, p._zero.shard_numel, self.rank)
            if hi > lo:
                full[lo:hi].copy_(p._zero.shard[: hi - lo])
            fulls.append(full)
        mine = [p._zero.shard for p in params]
        work, headers = self._exchange_pieces(Kind.PARAM_GATHER, mine, fulls, slot.sizes, header, tag)
        handle.direct = work
        if header is not None:
            handle.slot = self._register(Kind.PARAM_GATHER, slot.sizes, [work], headers)
        return handle

    def _gather_quantized(self, params: Sequence[ZeroParameter], tag: Tag, handle: GatherWork) -> GatherWork:
        """qwZ: every rank's shards travel as int8 blocks with fp32 scales (about a quarter of fp32's
        bytes); each rank's gathered weight is the dequantized value of every piece, its own included,
        so every rank computes with the same weights. Shards, masters and the optimizer stay exact."""
        layout = [_quantized_layout(p._zero.shard_numel, self.quant_block) for p in params]
        size = sum(v + 4 * nb for _, v, nb in layout)
        slot = Slot(Kind.PARAM_GATHER.value, (size,), "quantized", False)
        route = self._route(tag, slot)
        header = self._planned_header(Kind.PARAM_GATHER, tag.ids, slot.sizes) if route is Route.PLANNED else None
        payload = torch.zeros(size + (HEADER_BYTES if self.verify else 0), dtype=torch.uint8, device=self.device)
        off = 0
        for p, (s, v, nb) in zip(params, layout):
            values, scales = quantize.quantize(p._zero.shard, self.quant_block)
            payload[off: off + s].copy_(values.view(torch.uint8))
            payload[off + v: off + v + 4 * nb].copy_(scales.view(torch.uint8))
            off += v + 4 * nb
        return self._gather_payload(Kind.PARAM_GATHER, params, payload, size, layout, header, tag, handle)

    def _gather_payload(self, kind: Kind, params: Sequence[ZeroParameter], payload: torch.Tensor, size: int,
                        layout: list[tuple[int, int, int]], header: PayloadHeader | None, tag: Tag,
                        handle: GatherWork) -> GatherWork:
        """All-gather a quantized ``payload`` (``size`` bytes, then the header room when verifying);
        the work's ``wait()`` dequantizes every row into the parameters."""
        if self.verify:
            payload[size:].copy_(header_as(torch.uint8, header, self.device) if header is not None
                                 else torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=self.device))
        rows, work = self._gather_wire(payload, True, tag, kind, HEADER_BYTES if self.verify else 0)
        handle.direct = work if work is not None else _Pairwise([])
        handle.quantized = (rows, layout)
        if header is not None:
            handle.slot = self._register(kind, (size,), [handle.direct],
                                         lambda: headers_from(torch.stack([row[-HEADER_BYTES:] for row in rows])))
        return handle

    def _dequantize_gather(self, params: Sequence[ZeroParameter], rows: list[torch.Tensor],
                           layout: list[tuple[int, int, int]], span: int = 1) -> None:
        """Write every row's quantized pieces into the parameters' storage. Row q holds, per parameter,
        the pieces of primary ranks ``q * span`` .. ``q * span + span - 1`` (``span`` > 1: the rows of an
        hpZ secondary gather, each a secondary slice of ``span`` primary shards)."""
        for q, row in enumerate(rows):
            off = 0
            for p, (s, v, nb) in zip(params, layout):
                z = p._zero
                full = alloc_full(p) if q == 0 else raw_data(p).view(-1)
                for i in range(span):
                    lo, hi = _piece(z.numel, s, q * span + i)
                    if hi > lo:
                        values = row[off: off + s].view(torch.int8)
                        scales = row[off + v: off + v + 4 * nb].view(torch.float32)
                        full[lo:hi].copy_(quantize.dequantize(values, scales, s, self.quant_block)[: hi - lo])
                    off += v + 4 * nb

    # -- hpZ: secondary slices and the gathers inside a secondary group ---------------------------
    def _secondaries(self, params: Sequence[ZeroParameter], quantized: Any) -> dict[int, Secondary]:
        """Each parameter's secondary slice, cut from a finished gather: from the quantized rows as
        they arrived under qwZ, else from the gathered storage (a copy of 1/``hpz`` of it)."""
        size = self.hpz
        span, local = self.world_size // size, self.rank % size
        out: dict[int, Secondary] = {}
        if quantized is not None:
            rows, layout = quantized
            off = 0
            for p, (s, v, nb) in zip(params, layout):
                seg = v + 4 * nb
                pieces = [rows[local * span + i][off: off + seg] for i in range(span)]
                out[p._zero.id] = Secondary(torch.cat(pieces), quantized=True)
                off += seg
            return out
        for p in params:
            z = p._zero
            data = torch.zeros(sharding.secondary_numel(z.numel, self.world_size, size), dtype=raw_data(p).dtype,
                               device=raw_data(p).device)
            lo, hi = sharding.secondary_range(z.numel, self.world_size, size, local)
            if hi > lo:
                data[: hi - lo].copy_(raw_data(p).view(-1)[lo:hi])
            out[z.id] = Secondary(data, quantized=False)
        return out

    def all_gather_secondary(self, params: Sequence[ZeroParameter], tag: Tag) -> GatherWork:
        """hpZ, on a secondary group's communicator (`hierarchical`): gather ``params`` from the
        secondary slices its ranks keep (``p._zero.secondary``, all quantized or all not), so the bytes
        stay inside the group (the node). Quantized slices travel as they are and are dequantized
        like a qwZ gather's rows; the others go as pairwise pieces straight into storage."""
        handle = GatherWork(comm=self, params=params, tag=Tag(Kind.SECONDARY_GATHER, tag.label, tag.ids),
                            span=self.secondary_span)
        if not params:
            return handle
        m = self.metrics
        m.allgather_calls += 1
        m.allgather_numel += sum(p._zero.numel for p in params)
        m.allgather_bytes += sum(p._zero.nbytes for p in params)
        kind, span, w = Kind.SECONDARY_GATHER, self.secondary_span, self.world_size
        secondaries: list[Secondary] = [p._zero.secondary for p in params]
        if secondaries[0].quantized:
            layout = [_quantized_layout(p._zero.shard_numel, self.quant_block) for p in params]
            size = sum(span * (v + 4 * nb) for _, v, nb in layout)
            slot = Slot(kind.value, (size,), "quantized", False)
            route = self._route(handle.tag, slot)
            header = self._planned_header(kind, tag.ids, slot.sizes) if route is Route.PLANNED else None
            payload = torch.empty(size + (HEADER_BYTES if self.verify else 0), dtype=torch.uint8, device=self.device)
            off = 0
            for sec in secondaries:
                payload[off: off + sec.nbytes].copy_(sec.data)
                off += sec.nbytes
            return self._gather_payload(kind, params, payload, size, layout, header, handle.tag, handle)
        dtype = secondaries[0].data.dtype
        slot = Slot(kind.value, tuple(p._zero.numel for p in params), str(dtype), False, span)
        route = self._route(handle.tag, slot)
        header = self._planned_header(kind, tag.ids, slot.sizes) if route is Route.PLANNED else None
        fulls = []
        for p, sec in zip(params, secondaries):
            full = alloc_full(p)
            lo, hi = sharding.secondary_range(p._zero.numel, span * w, w, self.rank)
            if hi > lo:
                full[lo:hi].copy_(sec.data[: hi - lo])
            fulls.append(full)
        work, headers = self._exchange_pieces(kind, [sec.data for sec in secondaries], fulls, slot.sizes, header,
                                              handle.tag, span)
        handle.direct = work
        if header is not None:
            handle.slot = self._register(kind, slot.sizes, [work], headers)
        return handle

    def _exchange_pieces(self, kind: Kind, mine: Sequence[torch.Tensor], into: Sequence[torch.Tensor],
                         numels: Sequence[int], header: PayloadHeader | None, tag: Tag | None,
                         span: int = 1) -> tuple[Any, Any]:
        """Post the pairwise messages of a direct gather: for every tensor of ``numels``, this rank's
        real piece from ``mine[i]`` to every peer, and every peer's piece into its range of ``into[i]``;
        then the header, if any. A piece is ``span`` primary shards of ``ceil(n / (span * world))``
        elements (1: this group's own shards). Returns (work, a reader of every rank's header)."""
        w, r = self.world_size, self.rank
        t = self._next_tag()
        ops = []
        for q in range(w):
            if q == r:
                continue
            g = self.global_rank(q)
            for src, dst, n in zip(mine, into, numels):
                s = span * -(-n // (span * w))
                lo, hi = _piece(n, s, r)
                if hi > lo:
                    ops.append(dist.P2POp(dist.isend, src[: hi - lo], g, self.group, t))
                qlo, qhi = _piece(n, s, q)
                if qhi > qlo:
                    ops.append(dist.P2POp(dist.irecv, dst[qlo:qhi], g, self.group, t))
                    self._count(kind, q, (qhi - qlo) * dst.element_size(), True)
        got: dict[int, torch.Tensor] = {}
        if header is not None:
            own = torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8).to(self.device)
            for q in range(w):
                if q != r:
                    got[q] = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                    ops += [dist.P2POp(dist.isend, own, self.global_rank(q), self.group, t),
                            dist.P2POp(dist.irecv, got[q], self.global_rank(q), self.group, t)]
                    self._count(VERIFICATION, q, HEADER_BYTES, True)

        def headers() -> list[PayloadHeader | None]:
            return [header if q == r else PayloadHeader.from_bytes(bytes(got[q].cpu().tolist())) for q in range(w)]

        work = _Pairwise(self._blocking(lambda: dist.batch_isend_irecv(ops), tag) if ops else [])
        return work, headers

    def _chunks(self, params: Sequence[ZeroParameter]) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        cur: list[ZeroParameter] = []
        cur_numel = 0
        for p in params:
            if cur and cur_numel + p._zero.numel > self.bucket_numel:
                chunks.append(_make_chunk(cur))
                cur, cur_numel = [], 0
            cur.append(p)
            cur_numel += p._zero.numel
        if cur:
            chunks.append(_make_chunk(cur))
        return chunks

    # -- the wire: collectives, or pairwise messages where those were measured faster ------------
    def _next_tag(self) -> int:
        self._p2p_tag = (self._p2p_tag + 1) & 0xFFFFFF  # the same on every rank: the sequence is verified
        return self._p2p_tag

    def _gather_wire(self, inp: torch.Tensor, async_op: bool, tag: Tag | None, kind: Kind,
                     header_numel: int) -> tuple[list[torch.Tensor], Any]:
        """Every rank's ``inp`` (the same size everywhere), as one row per rank; and the work to wait
        for (None when done). With ``allgather_impl="p2p"`` each rank sends its piece to every other
        rank and receives theirs: the same bytes as a ring all-gather, without gloo's extra copies.
        The last ``header_numel`` elements of each row are counted as verification, the rest as ``kind``."""
        n, w = inp.numel(), self.world_size
        size = inp.element_size()
        pairwise = self.allgather_impl == "p2p" and inp.device != _META  # meta: see all_gather_params
        self._count_peers(kind, (n - header_numel) * size, header_numel * size, pairwise)
        if pairwise:
            rows: list[torch.Tensor] = []
            ops = []
            t = self._next_tag()
            for peer in range(w):
                if peer == self.rank:
                    rows.append(inp)
                    continue
                buf = torch.empty(n, dtype=inp.dtype, device=inp.device)
                rows.append(buf)
                ops += [dist.P2POp(dist.isend, inp, self.global_rank(peer), self.group, t),
                        dist.P2POp(dist.irecv, buf, self.global_rank(peer), self.group, t)]
            work = _Pairwise(self._blocking(lambda: dist.batch_isend_irecv(ops), tag))
            if not async_op:
                self._wait_work(work, tag)
                return rows, None
            return rows, work
        out = torch.empty(w * n, dtype=inp.dtype, device=inp.device)
        work = self._blocking(lambda: _all_gather_flat(out, inp, group=self.group, async_op=async_op), tag)
        return list(out.view(w, n).unbind(0)), (work if async_op else None)

    def _reduce_wire(self, flat: torch.Tensor, out: torch.Tensor, async_op: bool, tag: Tag | None,
                     header_numel: int) -> Any:
        """Sum every rank's ``flat`` (rank-major: chunk r is for rank r) and leave this rank's summed
        chunk in ``out`` (reduce-scatter), or with ``all_reduce`` sum it whole in place. Returns the
        work (None when done). ``header_numel``: header room in each chunk (in the whole ``flat`` for
        ``all_reduce``), counted as verification."""
        w, r = self.world_size, self.rank
        per_peer = flat.numel() if self.reduce_impl == "all_reduce" else flat.numel() // w
        size = flat.element_size()
        self._count_peers(Kind.GRAD_REDUCE, (per_peer - header_numel) * size, header_numel * size,
                          self.reduce_impl == "p2p")
        if self.reduce_impl == "p2p":
            chunks = flat.view(w, -1)
            n = chunks.shape[1]
            received: dict[int, torch.Tensor] = {}
            ops = []
            t = self._next_tag()
            for peer in range(w):
                if peer != r:
                    received[peer] = torch.empty(n, dtype=flat.dtype, device=flat.device)
                    ops += [dist.P2POp(dist.isend, chunks[peer], self.global_rank(peer), self.group, t),
                            dist.P2POp(dist.irecv, received[peer], self.global_rank(peer), self.group, t)]

            def total() -> None:  # in rank order, the same on every rank
                out.copy_(chunks[r] if r == 0 else received[0])
                for peer in range(1, w):
                    out.add_(chunks[r] if peer == r else received[peer])

            work = _Pairwise(self._blocking(lambda: dist.batch_isend_irecv(ops), tag), total)
        elif self.reduce_impl == "all_reduce":
            work = self._blocking(lambda: dist.all_reduce(flat, group=self.group, async_op=True), tag)
        else:
            work = self._blocking(lambda: _reduce_scatter_flat(out, flat, group=self.group, async_op=True), tag)
        if not async_op:
            self._wait_work(work, tag)
            return None
        return work

    def _issue(self, chunk: _Chunk, hdr: int, header: PayloadHeader | None, *, async_op: bool) -> None:
        first = chunk.params[0]._zero.shard
        device = raw_data(chunk.params[0]).device
        dtype = first.dtype
        pieces = [p._zero.shard.to(device=device, dtype=dtype) for p in chunk.params]
        if hdr:
            pieces.append(header_as(dtype, header, device) if header is not None
                          else torch.zeros(hdr, dtype=dtype, device=device))
        inp = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        with _label("zero3::all_gather"):
            chunk.rows, chunk.work = self._gather_wire(inp, async_op, None, Kind.PARAM_GATHER, hdr)

    def _side(self, device: torch.device) -> Any:
        """The side stream, after it waited for the compute stream ([Note: streams and buffer lifetime])."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=device)
        self._side_stream.wait_stream(torch.cuda.current_stream(device))
        return self._side_stream

    def _copy_out(self, chunk: _Chunk, keep_header: bool = False) -> None:
        """Copy each parameter's piece of every rank's row into its own storage (one copy each)."""
        if self.world_size == 1:
            for p in chunk.params:
                alloc_full(p).copy_(p._zero.shard[: p._zero.numel])
            return
        assert chunk.rows is not None
        for p, off in zip(chunk.params, chunk.offsets):
            z = p._zero
            full = alloc_full(p)
            s, n = z.shard_numel, z.numel
            for r, row in enumerate(chunk.rows):
                lo = r * s
                if lo >= n:
                    break
                hi = min(lo + s, n)
                full[lo:hi].copy_(row[off: off + hi - lo])
        chunk.rows = [row[chunk.total:] for row in chunk.rows] if keep_header else None

    def _dummy(self, slot: Slot) -> _Slot:
        """Issue a planned slot with zeros and the LEAVING flag (see [Note: verified collectives])."""
        kind = Kind(slot.kind)
        dtype = getattr(torch, slot.dtype.removeprefix("torch."), torch.uint8)
        header = self._planned_header(kind, (), slot.sizes, LEAVING)
        tag = Tag(kind, "leaving the plan")
        if slot.header_first:
            mine = WireHeader(self.epoch, self._seq, _KIND_CODES[kind], 0, 0, flags=LEAVING)
            self._wire_exchange(mine, tag)
            return _Slot(self._seq, kind, slot.sizes, [], lambda: [], void=True)
        works: list[Any] = []
        gather = kind in (Kind.PARAM_GATHER, Kind.SECONDARY_GATHER)
        w, h = self.world_size, HEADER_VALUES * self.world_size
        if gather and slot.dtype == "quantized":
            payload = torch.zeros(slot.sizes[0] + HEADER_BYTES, dtype=torch.uint8, device=self.device)
            payload[slot.sizes[0]:].copy_(header_as(torch.uint8, header, self.device))
            works.append(self._gather_wire(payload, True, tag, kind, HEADER_BYTES)[1])
        elif gather and (self.allgather_impl == "p2p" or kind is Kind.SECONDARY_GATHER):
            # a direct gather's messages (pieces of `span` primary shards), into scratch
            span = slot.span
            pieces = [torch.zeros(span * -(-n // (span * w)), dtype=dtype, device=self.device) for n in slot.sizes]
            scratch = [torch.empty(n, dtype=dtype, device=self.device) for n in slot.sizes]
            works.append(self._exchange_pieces(kind, pieces, scratch, slot.sizes, header, tag, span)[0])
        elif gather:
            hdr = bitcast_elements(dtype)
            for total in slot.sizes:
                inp = torch.cat([torch.zeros(total, dtype=dtype, device=self.device),
                                 header_as(dtype, header, self.device)])
                works.append(self._gather_wire(inp, True, tag, kind, hdr)[1])
        elif kind is Kind.GRAD_REDUCE and slot.dtype.startswith("quantized"):
            payload = torch.zeros(slot.sizes[0] + HEADER_BYTES, dtype=torch.uint8, device=self.device)
            payload[slot.sizes[0]:].copy_(header_as(torch.uint8, header, self.device))
            works.append(self._exchange_payloads({q: payload for q in range(self.world_size)}, tag, HEADER_BYTES)[0])
        elif kind is Kind.GRAD_REDUCE and self.reduce_impl == "p2p":  # a direct reduction's messages
            pieces = [GradPiece(n, -(-n // self.world_size), None) for n in slot.sizes[:-1]]
            presence = torch.zeros(slot.sizes[-1], dtype=dtype, device=self.device)
            works.append(self._exchange_grads(pieces, [None] * len(pieces), presence, header, dtype, self.device,
                                              tag)[0])
        elif kind is Kind.GRAD_REDUCE:  # the same wire as a real reduction of the planned size
            flat = torch.zeros(slot.sizes[0], dtype=dtype, device=self.device)
            out = torch.empty(slot.sizes[0] // self.world_size, dtype=dtype, device=self.device)
            works.append(self._reduce_wire(flat, out, True, tag, h))
        else:  # ALL_REDUCE: one flat all-reduce of the planned size
            flat = torch.zeros(slot.sizes[0], dtype=dtype, device=self.device)
            works.append(self._blocking(lambda: dist.all_reduce(flat, group=self.group, async_op=True), tag))
            self._count_peers(kind, (flat.numel() - h) * flat.element_size(), h * flat.element_size())
        self.metrics.dummy_collectives += 1
        return _Slot(self._seq, kind, slot.sizes, works, lambda: [], void=True)

    # -- gradient reduction ----------------------------------------------------------------------
    def reduce_grads(self, pieces: Sequence[GradPiece], dtype: torch.dtype, device: torch.device,
                     tag: Tag) -> ReduceWork:
        """Issue the averaging reduction of ``pieces`` in ``dtype``. The work's ``wait()`` gives this
        rank's averaged slice of every piece, back to back (``shard_numel`` each, padding zeros), then
        one presence value per counted piece (> 0 when some rank had its gradient). With ``overlap``
        it runs while backward goes on; the full gradients may be dropped once it is issued."""
        total = sum(p.shard_numel for p in pieces)
        counted = sum(1 for p in pieces if p.counted)
        self.metrics.reduce_calls += 1
        self.metrics.reduce_numel += total * self.world_size
        if self.quantize_gradients and self.world_size > 1:
            return self._reduce_quantized(pieces, total, counted, device, tag)
        if self.reduce_impl == "p2p" and self.world_size > 1:
            return self._reduce_direct(pieces, total, counted, dtype, device, tag)
        buf = self._reduce_buffer(total + counted, dtype, device)
        rows, w, col = buf.rows, self.world_size, total
        off = 0
        for piece in pieces:
            s = piece.shard_numel
            if piece.grad is not None:
                src = piece.grad.reshape(-1)
                if piece.numel == s * w:
                    rows[:, off: off + s].copy_(src.view(w, s))
                else:  # the last ranks' pieces are padded with zeros
                    for r in range(w):
                        lo, hi = _piece(piece.numel, s, r)
                        if hi > lo:
                            rows[r, off: off + hi - lo].copy_(src[lo:hi])
            if piece.counted:
                if piece.grad is not None:
                    rows[:, col].fill_(1)  # every rank's slice learns that this rank had a gradient
                col += 1
            off += s
        return self._reduce_flat(buf, tag)

    def _reduce_direct(self, pieces: Sequence[GradPiece], total: int, counted: int, dtype: torch.dtype,
                       device: torch.device, tag: Tag) -> ReduceWork:
        """``reduce_scatter_impl="p2p"``: each rank sends every other rank that rank's part of each
        gradient straight from the gradient (no copy into a flat buffer) and sums what it receives."""
        w, r = self.world_size, self.rank
        sizes = tuple(p.numel for p in pieces) + (counted,)
        slot = Slot(Kind.GRAD_REDUCE.value, sizes, str(dtype), False)
        route = self._route(tag, slot)
        header = self._planned_header(Kind.GRAD_REDUCE, tag.ids, sizes) if route is Route.PLANNED else None
        # The first peer's message lands straight in the result (two ranks: no other buffer, and
        # this rank's own part is added on arrival, with no copy). a + b == b + a exactly, and with
        # more ranks every element's sum runs in the same order, so results repeat bit for bit.
        out = torch.empty(total + counted, dtype=dtype, device=device)
        grads = [p.grad.reshape(-1).to(dtype) if p.grad is not None else None for p in pieces]
        presence = torch.tensor([1.0 if g is not None else 0.0 for piece, g in zip(pieces, grads) if piece.counted],
                                dtype=dtype, device=device)
        first = 1 if r == 0 else 0
        work, received = self._exchange_grads(pieces, grads, presence, header, dtype, device, tag, first_into=out)

        def total_up() -> None:
            off = 0
            for piece, g in zip(pieces, grads):
                lo, hi = _piece(piece.numel, piece.shard_numel, r)
                if g is not None and hi > lo:
                    out[off: off + hi - lo].add_(g[lo:hi])
                off += piece.shard_numel
            if counted:
                out[total:].add_(presence)
            for q in range(w):
                if q not in (r, first):
                    out.add_(received[q])

        work.then = total_up
        rw = ReduceWork(comm=self, buffer=ReduceBuffer(flat=out, rows=out.view(1, -1),
                                                       shard_numel=total + counted), out=out, tag=tag, work=work)
        if header is not None:
            rw.slot = self._register(Kind.GRAD_REDUCE, sizes, [work], work.headers)
        if not self.overlap:
            self._wait_work(work, tag)
        return rw

    def _reduce_quantized(self, pieces: Sequence[GradPiece], total: int, counted: int, device: torch.device,
                          tag: Tag) -> ReduceWork:
        """qgZ: each rank sends every other rank that rank's part of each gradient as int8 (or int4)
        blocks with scales; the receiver dequantizes every message before adding it to its own exact
        part, in fp32, so the error is one rounding per message and never compounds. The reduced
        shard stays fp32."""
        w, r, bits, block = self.world_size, self.rank, self.quantize_gradients, self.quant_block
        layout = [(p.shard_numel, quantize.value_bytes(p.shard_numel, bits), quantize.blocks(p.shard_numel, block))
                  for p in pieces]
        size = sum(v + 4 * nb for _, v, nb in layout) + 4 * counted
        slot = Slot(Kind.GRAD_REDUCE.value, (size,), f"quantized{bits}", False)
        route = self._route(tag, slot)
        header = self._planned_header(Kind.GRAD_REDUCE, tag.ids, slot.sizes) if route is Route.PLANNED else None
        out = torch.zeros(total + counted, dtype=torch.float32, device=device)
        grads = [p.grad.reshape(-1).float() if p.grad is not None else None for p in pieces]
        bits_present = torch.tensor([1.0 if g is not None else 0.0 for p, g in zip(pieces, grads) if p.counted],
                                    dtype=torch.float32, device=device)
        payloads: dict[int, torch.Tensor] = {}
        for q in range(w):
            payload = torch.zeros(size + (HEADER_BYTES if self.verify else 0), dtype=torch.uint8, device=self.device)
            off, col = 0, 0
            for piece, g, (sh, v, nb) in zip(pieces, grads, layout):
                lo, hi = _piece(piece.numel, sh, q)
                if q == r:  # this rank's own part: exact, never on the wire
                    if g is not None and hi > lo:
                        out[col: col + hi - lo].copy_(g[lo:hi])
                elif g is not None and hi > lo:
                    part = torch.zeros(sh, dtype=torch.float32, device=device)
                    part[: hi - lo].copy_(g[lo:hi])
                    values, scales = quantize.quantize(part, block, bits)
                    payload[off: off + values.numel()].copy_(values.view(torch.uint8))
                    payload[off + v: off + v + 4 * nb].copy_(scales.view(torch.uint8))
                off += v + 4 * nb
                col += sh
            if counted:
                payload[off: off + 4 * counted].copy_(bits_present.view(torch.uint8))
            if header is not None:
                payload[size:].copy_(header_as(torch.uint8, header, self.device))
            payloads[q] = payload
        if counted:
            out[total:] = bits_present
        work, received = self._exchange_payloads(payloads, tag, HEADER_BYTES if self.verify else 0)

        def total_up() -> None:  # every message dequantized, then added in fp32, in rank order
            for q in range(w):
                if q == r:
                    continue
                row, off, col = received[q], 0, 0
                for sh, v, nb in layout:
                    values = row[off: off + v] if bits == 4 else row[off: off + v].view(torch.int8)
                    scales = row[off + v: off + v + 4 * nb].view(torch.float32)
                    out[col: col + sh].add_(quantize.dequantize(values, scales, sh, block, bits))
                    off += v + 4 * nb
                    col += sh
                if counted:
                    out[total:].add_(row[off: off + 4 * counted].view(torch.float32))

        work.then = total_up
        rw = ReduceWork(comm=self, buffer=ReduceBuffer(flat=out, rows=out.view(1, -1), shard_numel=total + counted),
                        out=out, tag=tag, work=work)
        if header is not None:
            rw.slot = self._register(Kind.GRAD_REDUCE, slot.sizes, [work], lambda: [
                header if q == r else PayloadHeader.from_bytes(bytes(received[q][-HEADER_BYTES:].cpu().tolist()))
                for q in range(w)])
        if not self.overlap:
            self._wait_work(work, tag)
        return rw

    def _exchange_payloads(self, payloads: dict[int, torch.Tensor], tag: Tag | None, header_bytes: int
                           ) -> tuple[_Pairwise, dict[int, torch.Tensor]]:
        """Send ``payloads[q]`` (the same size for every q, its last ``header_bytes`` a header) to each
        other rank q and receive each one's payload for this rank: pairwise messages, or one
        all-to-all for collective wires."""
        w, r = self.world_size, self.rank
        n = payloads[r].numel()
        self._count_peers(Kind.GRAD_REDUCE, n - header_bytes, header_bytes, self.reduce_impl == "p2p")
        if self.reduce_impl == "p2p":
            t = self._next_tag()
            received = {q: torch.empty(n, dtype=torch.uint8, device=self.device) for q in range(w) if q != r}
            ops = [op for q in received for op in (
                dist.P2POp(dist.isend, payloads[q], self.global_rank(q), self.group, t),
                dist.P2POp(dist.irecv, received[q], self.global_rank(q), self.group, t))]
            work = _Pairwise(self._blocking(lambda: dist.batch_isend_irecv(ops), tag))
            work.keep = list(payloads.values())
            return work, received
        send = torch.stack([payloads[q] for q in range(w)]).view(-1)
        recv = torch.empty(w * n, dtype=torch.uint8, device=self.device)
        handle = self._blocking(lambda: dist.all_to_all_single(recv, send, group=self.group, async_op=True), tag)
        work = _Pairwise([handle])
        work.keep = [send]
        return work, {q: recv[q * n:(q + 1) * n] for q in range(w) if q != r}

    def _exchange_grads(self, pieces: Sequence[GradPiece], grads: Sequence[torch.Tensor | None],
                        presence: torch.Tensor, header: PayloadHeader | None, dtype: torch.dtype,
                        device: torch.device, tag: Tag | None, first_into: torch.Tensor | None = None
                        ) -> tuple[_Pairwise, dict[int, torch.Tensor]]:
        """Post a direct reduction's messages: to each peer, its part of every gradient (zeros where
        there is none) and this rank's presence bits; from each peer, its part of this rank's range
        into a buffer laid out like the result (``first_into`` for the lowest other rank), its
        padding zeroed. Then the header, if any."""
        w, r = self.world_size, self.rank
        total = sum(p.shard_numel for p in pieces)
        t = self._next_tag()
        ops, keep = [], list(grads)
        zeros = (torch.zeros(max((p.shard_numel for p in pieces), default=0), dtype=dtype, device=device)
                 if any(g is None for g in grads) else None)
        received: dict[int, torch.Tensor] = {}
        got: dict[int, torch.Tensor] = {}
        size = torch.empty((), dtype=dtype).element_size()
        mine = sum(hi - lo for lo, hi in (_piece(p.numel, p.shard_numel, r) for p in pieces)) + presence.numel()
        for q in range(w):
            if q == r:
                continue
            self._count(Kind.GRAD_REDUCE, q, mine * size, True)
            if header is not None:
                self._count(VERIFICATION, q, HEADER_BYTES, True)
            g_rank = self.global_rank(q)
            into = first_into if first_into is not None and q == min(p for p in range(w) if p != r) else None
            received[q] = into if into is not None else torch.empty(total + presence.numel(), dtype=dtype,
                                                                    device=device)
            off = 0
            for piece, g in zip(pieces, grads):
                qlo, qhi = _piece(piece.numel, piece.shard_numel, q)
                if qhi > qlo:
                    src = g[qlo:qhi] if g is not None else zeros[: qhi - qlo]
                    ops.append(dist.P2POp(dist.isend, src, g_rank, self.group, t))
                lo, hi = _piece(piece.numel, piece.shard_numel, r)
                if hi > lo:
                    ops.append(dist.P2POp(dist.irecv, received[q][off: off + hi - lo], g_rank, self.group, t))
                if hi - lo < piece.shard_numel:  # this rank's padding: nothing arrives there
                    received[q][off + max(hi - lo, 0): off + piece.shard_numel].zero_()
                off += piece.shard_numel
            if presence.numel():
                ops += [dist.P2POp(dist.isend, presence, g_rank, self.group, t),
                        dist.P2POp(dist.irecv, received[q][total:], g_rank, self.group, t)]
            if header is not None:
                own = torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8).to(device)
                got[q] = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
                ops += [dist.P2POp(dist.isend, own, g_rank, self.group, t),
                        dist.P2POp(dist.irecv, got[q], g_rank, self.group, t)]
                keep.append(own)
        work = _Pairwise(self._blocking(lambda: dist.batch_isend_irecv(ops), tag) if ops else [])
        work.keep = keep  # the gradients stay alive until their sends completed

        def headers() -> list[PayloadHeader | None]:
            return [header if q == r else PayloadHeader.from_bytes(bytes(got[q].cpu().tolist())) for q in range(w)]

        work.headers = headers
        return work, received

    def _reduce_buffer(self, shard_numel: int, dtype: torch.dtype, device: torch.device) -> ReduceBuffer:
        """A zeroed buffer for one gradient bucket of ``shard_numel`` elements per rank."""
        w = self.world_size
        h = HEADER_VALUES * w if self.verify else 0
        if w == 1:
            flat = torch.zeros(shard_numel, dtype=dtype, device=device)
            return ReduceBuffer(flat=flat, rows=flat.view(1, -1), shard_numel=shard_numel)
        if self.reduce_impl == "all_reduce":
            flat = torch.zeros(w * shard_numel + h, dtype=dtype, device=device)
            return ReduceBuffer(flat=flat, rows=flat[: w * shard_numel].view(w, shard_numel), shard_numel=shard_numel)
        flat = torch.zeros(w, shard_numel + h, dtype=dtype, device=device)
        return ReduceBuffer(flat=flat.view(-1), rows=flat[:, :shard_numel], shard_numel=shard_numel)

    def _reduce_flat(self, buf: ReduceBuffer, tag: Tag) -> ReduceWork:
        """Issue the averaging reduction of a filled `ReduceBuffer` as a collective (``all_reduce`` or
        ``reduce_scatter``); the work's ``wait()`` gives this rank's elements."""
        flat = buf.flat
        w, s = self.world_size, buf.shard_numel
        if w == 1:
            return ReduceWork(comm=self, buffer=buf, out=flat)
        slot = Slot(Kind.GRAD_REDUCE.value, (flat.numel(),), str(flat.dtype), False)
        route = self._route(tag, slot)
        h = HEADER_VALUES * w if self.verify else 0
        header = None
        if route is Route.PLANNED:
            header = self._planned_header(Kind.GRAD_REDUCE, tag.ids, slot.sizes)
            values = header_values(header, flat.dtype, flat.device)
            if self.reduce_impl == "all_reduce":
                flat[w * s:].view(w, HEADER_VALUES)[self.rank].copy_(values)
            else:
                flat.view(w, s + h)[:, s:].reshape(w, w, HEADER_VALUES)[:, self.rank].copy_(values)
        with _label("zero3::reduce"):
            if self.reduce_impl == "all_reduce":  # in place; this rank's slice is its result
                out = flat[self.rank * s:(self.rank + 1) * s]
                hdr_rows = flat[w * s:].view(w, HEADER_VALUES) if h else None
            else:
                out = torch.empty(s + h, dtype=flat.dtype, device=flat.device)
                hdr_rows = out[s:].view(w, HEADER_VALUES) if h else None
            work = self._reduce_wire(flat, out, self.overlap, tag, h)
        rw = ReduceWork(comm=self, buffer=buf, out=out, tag=tag, work=work)
        if header is not None:
            assert hdr_rows is not None
            rw.slot = self._register(Kind.GRAD_REDUCE, slot.sizes, [rw.work] if rw.work is not None else [],
                                     lambda: headers_from_values(hdr_rows))
        return rw

    # -- small collectives -----------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, tag: Tag, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` in place over the ranks (``op``: ``sum`` or ``max``); returns ``t``."""
        if self.world_size == 1:
            return t
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        h = HEADER_VALUES * self.world_size if self.verify else 0
        n = t.numel()
        slot = Slot(Kind.ALL_REDUCE.value, (n + h,), str(t.dtype), False)
        route = self._route(tag, slot)
        payload = torch.zeros(n + h, dtype=t.dtype, device=t.device)
        payload[:n].copy_(t.reshape(-1))
        if route is Route.PLANNED:
            header = self._planned_header(Kind.ALL_REDUCE, tag.ids, slot.sizes)
            payload[n:].view(self.world_size, HEADER_VALUES)[self.rank].copy_(
                header_values(header, t.dtype, t.device))
        with _label("zero3::all_reduce"):
            work = self._blocking(lambda: dist.all_reduce(payload, op=reduce_op, group=self.group, async_op=True), tag)
        self._count_peers(Kind.ALL_REDUCE, n * t.element_size(), h * t.element_size())
        if route is Route.PLANNED:
            slot_rec = self._register(Kind.ALL_REDUCE, slot.sizes, [work],
                                      lambda: headers_from_values(payload[n:].view(self.world_size, HEADER_VALUES)))
            self._verify_through(slot_rec)
            if slot_rec.void:
                self._voided(tag, slot.sizes)
        else:
            self._wait_work(work, tag)
        t.copy_(payload[:n].view_as(t))
        return t

    def agree(self, tag: Tag) -> None:
        """Every rank reached this point and every collective before it was verified (a blocking
        header exchange). The engine calls it before the optimizer changes any shard."""
        if not self.verify:
            return
        self._route(tag, Slot(Kind.AGREE.value, (0,), "int64", True))

    def broadcast(self, t: torch.Tensor, src: int, tag: Tag) -> torch.Tensor:
        """Broadcast ``t`` in place from group rank ``src``; returns ``t``."""
        if self.world_size > 1:
            self._route_header_first(tag, t)
            with _label("zero3::broadcast"):
                self._blocking(lambda: dist.broadcast(t, src=self.global_rank(src), group=self.group), tag)
            if self.rank != src:
                self._count(Kind.BROADCAST, src, t.numel() * t.element_size(), False)
        return t

    def all_gather_tensor(self, t: torch.Tensor, tag: Tag) -> torch.Tensor:
        """Every rank's ``t`` (same size everywhere), stacked: shape ``(world, t.numel())``."""
        flat = t.reshape(-1).contiguous()
        if self.world_size == 1:
            return flat.view(1, -1)
        self._route_header_first(tag, flat)
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        with _label("zero3::all_gather_tensor"):
            self._blocking(lambda: _all_gather_flat(out, flat, group=self.group), tag)
        self._count_peers(Kind.TENSOR_GATHER, flat.numel() * flat.element_size())
        return out.view(self.world_size, -1)

    def gather_to_rank0(self, t: torch.Tensor, tag: Tag) -> torch.Tensor | None:
        """Every rank's ``t`` stacked on group rank 0 (``(world, t.numel())``); None elsewhere."""
        flat = t.reshape(-1).contiguous()
        if self.world_size == 1:
            return flat.view(1, -1)
        self._route_header_first(tag, flat)
        dst = self.global_rank(0)
        with _label("zero3::gather"):
            if self.rank == 0:
                rows = torch.empty(self.world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
                self._blocking(lambda: dist.gather(flat, list(rows.unbind(0)), dst=dst, group=self.group), tag)
                self._count_peers(Kind.GATHER_TO_ROOT, flat.numel() * flat.element_size())
                return rows
            self._blocking(lambda: dist.gather(flat, None, dst=dst, group=self.group), tag)
        return None

    def exchange_objects(self, obj: Any, tag: Tag) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (needs no numpy, unlike torch's object
        collectives)."""
        if self.world_size == 1:
            return [obj]
        self._route_header_first(tag, torch.empty(0))
        return self._objects(obj, Kind.OBJECTS)

    def _route_header_first(self, tag: Tag, t: torch.Tensor) -> None:
        self._route(tag, Slot(tag.kind.value, (t.numel(),), str(t.dtype), True))

    def _objects(self, obj: Any, kind: Kind | str | None) -> list[Any]:
        """Every rank's picklable ``obj`` (two all-gathers: sizes, then the padded bytes). ``kind``:
        what to count the bytes as (None: not counted, the topology exchange while constructing)."""
        data = pickle.dumps(obj)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        mine_size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._blocking(lambda: _all_gather_flat(sizes, mine_size, group=self.group), None)
        sizes = sizes.cpu()
        longest = max(1, int(sizes.max()))
        mine = torch.zeros(longest, dtype=torch.uint8)
        byte_view(mine)[: len(data)] = data
        rows = torch.empty(self.world_size * longest, dtype=torch.uint8, device=self.device)
        mine_dev = mine.to(self.device)
        self._blocking(lambda: _all_gather_flat(rows, mine_dev, group=self.group), None)
        if kind is not None:
            self._count_peers(kind, 8 + longest)
        rows = rows.view(self.world_size, longest).cpu()
        return [pickle.loads(bytes(byte_view(rows[r])[: int(sizes[r])])) for r in range(self.world_size)]

    def agree_on_errors(self, payload: Any, error: BaseException | None, tag: Tag) -> list[Any]:
        """All-gather ``payload`` and raise on every rank if any rank had an ``error``.

        Every rank raises the error of the lowest failing rank (its own exception object where that
        is itself), so all of them fail the same way and none waits in a later collective.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return [payload]
        described = None if error is None else (type(error).__name__, str(error))
        items = self.exchange_objects((payload, described), tag)
        for r, (_, desc) in enumerate(items):
            if desc is not None:
                if r == self.rank and error is not None:
                    raise error
                raise _rebuild_error(r, *desc)
        return [p for p, _ in items]


def _piece(numel: int, shard_numel: int, rank: int) -> tuple[int, int]:
    """The real (unpadded) range of a tensor of ``numel`` elements that ``rank`` holds."""
    lo = min(rank * shard_numel, numel)
    return lo, min(lo + shard_numel, numel)


def _quantized_layout(shard_numel: int, block: int) -> tuple[int, int, int]:
    """(elements, value bytes, blocks) of one int8-quantized shard in a message: its values, padded to
    4 bytes, then one fp32 scale per block."""
    return shard_numel, quantize.value_bytes(shard_numel, 8), quantize.blocks(shard_numel, block)


def _make_chunk(params: list[ZeroParameter]) -> _Chunk:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p._zero.shard_numel
    return _Chunk(params=params, offsets=offsets, total=total)


def _gather_headers(chunks: list[_Chunk], world: int, hdr: int, event: Any) -> list[PayloadHeader | None]:
    """Every rank's header of a planned gather: the first chunk's, and every chunk must carry it."""
    if event is not None:
        event.synchronize()
    found: list[PayloadHeader | None] | None = None
    for chunk in chunks:
        assert chunk.rows is not None
        cols = torch.stack([row[-hdr:] for row in chunk.rows])
        headers = headers_from(cols)
        if found is None:
            found = headers
        elif headers != found:
            return [None] * world
    return found or [None] * world


def _group_name(group: Any) -> str:
    try:
        return str(group.group_name)
    except Exception:  # noqa: BLE001 - a name only for store keys
        return "default"


def _rebuild_error(rank: int, kind: str, message: str) -> BaseException:
    """Another rank's error, as an exception of the same type where that type is known."""
    import builtins

    from .. import errors

    known = getattr(errors, kind, None) or getattr(builtins, kind, None)
    if isinstance(known, type) and issubclass(known, Exception):
        return known(f"{message} [raised on rank {rank}]")
    return RuntimeError(f"rank {rank} failed with {kind}: {message}")


class _label:
    """``torch.profiler.record_function(name)`` when a profiler runs; free otherwise."""

    __slots__ = ("name", "cm")

    def __init__(self, name: str) -> None:
        self.name = name
        self.cm: Any = None

    def __enter__(self) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            self.cm = torch.profiler.record_function(self.name)
            self.cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.cm is not None:
            self.cm.__exit__(*exc)
