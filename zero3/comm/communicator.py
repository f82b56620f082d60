"""The communicator: every collective zero3 issues goes through one `Communicator`.

Parameter gathers, gradient reductions, broadcasts, all-reduces, gathers to rank 0, object exchanges
and step agreements all pass here, so verification, metrics, profiler labels, timeouts and test
doubles live in one place, and the torch-version shims exist once. Each call names what it moves
with a `Tag` (its kind, a label for messages, the parameter ids it carries). No other module of
zero3 calls ``torch.distributed`` collectives (tests/unit/test_structure.py reads the source).

The class is a facade over small pieces, each in the file named after its job:

- gather.py: where a parameter gather is issued, on a gather transport chosen at construction;
- reduce.py: where a gradient reduction is issued, on a reduce transport chosen at construction;
- verifier.py: the verification state machine ([Note: verified collectives] in verify.py);
- counter.py: byte counting; failure.py: timeouts and failure reports; works.py: waiting;
- codec.py: qwZ / qgZ coding; secondary.py: hpZ's secondary slices; hpz.py: the secondary group's communicator;
- collectives.py: the small collectives (all-reduce, broadcast, object exchange, ...);
- streams.py: the CUDA side stream; wire.py: what the transports share.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import ZeroConfigError
from ..metrics import StepMetrics
from ..partition.param import ZeroParameter
from .codec import QuantizedCodec
from .collectives import SmallCollectives
from .settings import CommSettings
from .counter import ByteCounter
from .exit_release import track_for_exit
from .own_groups import own_group
from .process_group import backend_of
from .failure import FailureMonitor, rebuild_error
from .gather import ParamGatherer, gather_transport
from .secondary import Secondary, SecondaryCutter
from .shared import SharedShards, SlotSpec, available as shared_memory_available
from .shared_reduce import SharedOutbox, SharedReduce
from .reduce import (GradPiece, QuantizedReduction, ReduceBuffer, ReduceRequest, ReduceTransport, hold_bytes,
                     reduce_transport)
from .tags import Kind, Tag
from .topology import hpz_group_size, node_identity, node_ids
from .verifier import Verifier
from .verify import EpochMode, EpochState, FailureReport, PayloadHeader, RequestShape
from .wire import Wire, group_alive, group_info, group_name, group_ranks, same_group
from .works import GatherWork, ReduceWork, WaitContext

__all__ = ["CommSettings", "Communicator", "GatherWork", "GradPiece", "Kind", "ReduceBuffer", "ReduceWork",
           "Secondary", "Tag", "group_alive", "group_info", "group_ranks", "same_group"]

logger = logging.getLogger(__name__)

_GATHERS = (Kind.PARAM_GATHER, Kind.SECONDARY_GATHER)


class Communicator:
    """Collectives over one process group (``None`` with world size 1: every call is local).

    Args:
        group: the process group (`group_info`); ``world_size`` and ``rank`` are read from it unless given.
        config: the settings (`CommSettings`; ``CommSettings.from_config`` builds them from a `ZeroConfig`).
        metrics: the step counters to update (the runtime context's).
        nodes: the node of every rank of the group (topology.py); None: every rank sends its
            `node_identity` to the others now (a collective: build communicators on every rank).
        dedicated: ``group`` is already zero3's own group with ``timeout_s`` (hpz.py makes one).
        secondary_span: on an hpZ secondary group's communicator: primary shards per secondary slice.

    Every byte received on the wire after construction (the node-name exchange is not) is counted in
    ``metrics.recv_bytes`` by kind and by node scope (intra / inter; shared-memory reads apart, in
    ``shared_read_bytes`` and ``shared_reduce_bytes``): pairwise messages exactly, collectives by the logical bytes each peer contributes.
    """

    def __init__(self, group: Any, config: CommSettings | None = None, *, metrics: StepMetrics,
                 world_size: int | None = None, rank: int | None = None, nodes: Sequence[int] | None = None,
                 dedicated: bool = False, secondary_span: int = 1) -> None:
        config = config if config is not None else CommSettings()
        if world_size is None or rank is None:
            group, world_size, rank = group_info(group)
        self.world_size = world_size
        self.rank = rank
        self.metrics = metrics
        distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.backend = backend_of(group) if distributed else "none"
        self.group = group
        self._own_group = dedicated  # made for zero3 (here, or by hpz.py): destroyed at exit (exit_release.py)
        # NCCL moves only CUDA tensors: small tensors (headers, flags) live there.
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        self._state = EpochState()
        users = 0  # communicators that ran on this group before this one
        if distributed and config.timeout_s > 0 and not dedicated:
            # Our own group: its timeout bounds every wait, and breaking it leaves the user's intact;
            # one per set of ranks (own_groups.py [Note: one own group per set of ranks]).
            self.group, users = own_group(group, config.timeout_s, self.backend, self.device, self)
            self._own_group = True
        report = FailureReport(f"{group_name(self.group)}/{users}", world_size, rank) if distributed else None
        self._monitor = FailureMonitor(self._state, report, world_size, rank, config.timeout_s,
                                       own_group=self._own_group)
        self._wire = Wire(self.group, world_size, rank, self.device, self._monitor,
                          ByteCounter(metrics, (0,) * world_size, rank))
        if nodes is None:
            nodes = node_ids(self._wire.objects(node_identity(), None)) if distributed else (0,) * world_size
        if len(nodes) != world_size:
            raise ZeroConfigError(f"nodes must name the node of each of the {world_size} ranks, got {list(nodes)}")
        self.nodes = tuple(nodes)
        gather_impl = _gather_impl(config, self.backend, self.nodes)
        self.config = config.replace(reduce_impl=_reduce_impl(config, self.backend, gather_impl),
                                     allgather_impl=gather_impl,
                                     verify=config.verify and world_size > 1)
        self.verify = bool(self.config.verify)
        self._monitor.counted = self.verify
        self._wire.counter = ByteCounter(metrics, self.nodes, rank)
        self._hpz = hpz_group_size(self.config.hpz_partition_size, self.nodes)
        self._secondary_span = secondary_span
        self._verifier = Verifier(self._wire, self._state, metrics, self.verify, self.config.plans, self._dummy)
        ctx = WaitContext(self._verifier, self._monitor, metrics)
        cfg = self.config
        codec = QuantizedCodec(cfg.quant_block, cfg.quantize_gradients)
        self._gatherer = ParamGatherer(self._wire, gather_transport(cfg.allgather_impl, self._wire), self._verifier,
                                       ctx, metrics, overlap=cfg.overlap, bucket_numel=cfg.bucket_numel,
                                       verify=self.verify, codec=codec if cfg.quantize_weights else None,
                                       secondary_span=secondary_span)
        self._reduce_transport: ReduceTransport = (
            SharedReduce(self._wire, self._verifier, ctx, cfg.overlap, self.verify)
            if cfg.reduce_impl == "shm" and world_size > 1
            else reduce_transport(cfg.reduce_impl, self._wire, self._verifier, ctx, cfg.overlap, self.verify))
        self._reduction: ReduceTransport | QuantizedReduction = (
            QuantizedReduction(self._reduce_transport, codec) if cfg.quantize_gradients and world_size > 1
            else self._reduce_transport)
        self._small = SmallCollectives(self._wire, self._verifier, self.verify)
        self._cutter = SecondaryCutter(world_size, self._hpz, rank) if self._hpz > 1 else None
        if distributed:
            track_for_exit(self)

    # -- what the runtime reads ------------------------------------------------------------------
    @property
    def hpz(self) -> int:
        """Ranks per hpZ secondary group (1: no secondary slices); `hpz.secondary_communicator` builds
        the secondary group's communicator when it is > 1."""
        return self._hpz

    @property
    def secondary_span(self) -> int:
        """On a secondary group's communicator: primary shards per secondary slice (else 1)."""
        return self._secondary_span

    @property
    def mode(self) -> EpochMode:
        """How the current epoch's collectives are verified."""
        return self._state.mode

    @property
    def side_stream(self) -> Any:
        """The CUDA side stream gathers ran on (None until one did)."""
        return self._gatherer.side.stream

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of ``group_rank`` in this communicator's group."""
        return self._wire.global_rank(group_rank)

    # -- epochs (verify.py [Note: verified collectives]) -----------------------------------------
    def end_epoch(self) -> None:
        """The runtime finished an epoch (``engine.step()``, or an inference forward): leave the plan
        if it is not done, remember what this epoch issued, and start counting afresh."""
        self._verifier.end_epoch()

    def abandon_epoch(self, reason: str | None = None) -> None:
        """The step was aborted (an exception): keep the others from waiting on slots this rank will
        not issue (leave the plan in-band), forget this epoch, and post ``reason`` for the others."""
        if reason is not None:
            self._monitor.post(f"{self._state.epoch}|{reason}")
        self._verifier.abandon_epoch()

    def release(self) -> None:
        """At exit (exit_release.py): forget every work in flight and let go of the process group,
        destroying it where zero3 made it. The communicator is not usable afterwards."""
        if self._gatherer.shared is not None:
            self._gatherer.shared.release()
        self._reduce_transport.release()
        self._verifier.forget()
        self._monitor.report = None  # and the store it reads
        group, self.group, self._wire.group = self.group, None, None
        if self._own_group and group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass  # destroyed already (destroy_process_group() of the default group destroys every group)

    def _dummy(self, shape: RequestShape, header: PayloadHeader, tag: Tag) -> list[Any]:
        """A void stand-in for a planned request a rank leaves the plan at, on the wire it used."""
        kind = Kind(shape.kind)
        if kind in _GATHERS:
            return self._gatherer.transport.dummy(shape, header, tag)
        if kind is Kind.GRAD_REDUCE:
            return self._reduce_transport.dummy(shape, header, tag)
        return self._small.dummy_all_reduce(shape, header, tag)

    # -- shared-memory gathers (shared.py [Note: shared shards]) ---------------------------------
    def share_shards(self, specs: Sequence[SlotSpec]) -> SharedShards | None:
        """A collective, with ``allgather_impl="shm"``: make this rank's arena for ``specs`` (the same on
        every rank) and open every peer's; the caller binds the shards to `SharedShards.slot` and calls
        `SharedShards.adopt`. None (on every rank) without ``shm``, or when some rank could not."""
        if self.config.allgather_impl != "shm" or self.world_size == 1 or not specs:
            return None
        shared = SharedShards.create(self.rank, specs,
                                     lambda obj: self.exchange_objects(obj, Tag(Kind.OBJECTS, "shared shards")),
                                     self._shared_barrier)
        self._gatherer.shared = shared
        transport = self._reduce_transport
        if shared is not None and isinstance(transport, SharedReduce) and transport.outbox is None:
            outbox = SharedOutbox.create(self.rank, lambda obj: self.exchange_objects(
                obj, Tag(Kind.OBJECTS, "shared reductions")))
            if outbox is not None:
                transport.share(outbox, shared)
        return shared

    @property
    def shared(self) -> SharedShards | None:
        """The arenas gathers read from, or None."""
        return self._gatherer.shared

    def step_began(self) -> None:
        """A step began: its first shared gather opens the window (a barrier)."""
        self._verifier.step_began()
        if self._gatherer.shared is not None:
            self._gatherer.shared.arm()

    def step_ended(self, aborted: bool) -> bool:
        """The step ended (every rank calls this at the same point unless ``aborted``): the window
        closes with a barrier, so no rank changes a shard while another reads it. True when an
        aborted step left peers possibly reading this rank's arena (`SharedShards.close`)."""
        if aborted:
            self._reduce_transport.step_aborted()
        return self._gatherer.shared is not None and self._gatherer.shared.close(aborted)

    def shards_will_change(self) -> None:
        """Every rank is about to change shards (a collective write-back): no peer reads them meanwhile."""
        if self._gatherer.shared is not None:
            self._gatherer.shared.pause()

    def _shared_barrier(self, values: list[int], label: str) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        return [int(v) for v in self._small.all_reduce(t, Tag(Kind.ALL_REDUCE, label), op="max").tolist()]

    # -- parameters and gradients ----------------------------------------------------------------
    def all_gather_params(self, params: Sequence[ZeroParameter], tag: Tag, count: bool = True,
                          keep_secondary: bool = False, quantize: bool = False) -> GatherWork:
        """Issue the all-gather of ``params``' shards into their own storage (split at ``bucket_numel``).

        The caller owns the parameters' status (NOT_AVAILABLE -> INFLIGHT -> AVAILABLE); this only
        moves bytes. Their storage is allocated when the gather is issued (direct, shared-memory and
        secondary gathers) or when the data is copied out (rows, qwZ). ``count``: add it to
        the step's gather metrics (persistent refreshes are counted apart). ``keep_secondary`` (hpZ,
        ``hpz`` > 1): the work's ``wait()`` also cuts each parameter's `Secondary` slice.
        ``quantize``: a training-path gather, which qwZ codes when ``quantize_weights`` is on; every
        other gather (what users read, write back or save) carries exact values.
        """
        return self._gatherer.all_gather_params(params, tag, count, self._cutter if keep_secondary else None,
                                                quantize)

    @property
    def quantizes_weights(self) -> bool:
        """Whether gathers asked to ``quantize`` hand out dequantized (int8-rounded) weights (qwZ)."""
        return self.config.quantize_weights and self.world_size > 1

    def all_gather_secondary(self, params: Sequence[ZeroParameter], tag: Tag) -> GatherWork:
        """hpZ, on a secondary group's communicator (`hpz.secondary_communicator`): gather ``params``
        from the secondary slices its ranks keep (``p._zero.secondary``, all quantized or all not), so
        the bytes stay inside the group (the node). Quantized slices travel as they are and are
        dequantized like a qwZ gather's rows; the others go as pairwise pieces straight into storage."""
        return self._gatherer.all_gather_secondary(params, tag)

    def reduce_grads(self, pieces: Sequence[GradPiece], dtype: torch.dtype, device: torch.device,
                     tag: Tag) -> ReduceWork:
        """Issue the averaging reduction of ``pieces`` in ``dtype``. The work's ``wait()`` gives this
        rank's averaged slice of every piece, back to back (``shard_numel`` each, padding zeros), then
        one presence value per counted piece (> 0 when some rank had its gradient). With ``overlap``
        it runs while backward goes on; the full gradients may be dropped once it is issued."""
        req = ReduceRequest(pieces, dtype, device, tag)
        self.metrics.reduce_calls += 1
        self.metrics.reduce_numel += req.total * self.world_size
        return self._reduction.reduce(req)

    def reduce_hold_bytes(self, numel: int, pieces: int, grad_itemsize: int, itemsize: int, holes: bool) -> int:
        """The most one bucket of ``numel`` gradient elements holds at once in this communicator's
        reductions (reduce.py `hold_bytes`)."""
        cfg = self.config
        return hold_bytes(cfg.reduce_impl, self.world_size, numel, pieces, grad_itemsize, itemsize, holes=holes,
                          verify=self.verify,
                          quantized=(cfg.quantize_gradients, cfg.quant_block) if cfg.quantize_gradients else None,
                          backend=self.backend)

    # -- small collectives (collectives.py) -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, tag: Tag, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` in place over the ranks (``op``: ``sum`` or ``max``); returns ``t``."""
        return self._small.all_reduce(t, tag, op)

    def agree(self, tag: Tag) -> None:
        """Every rank reached this point and every collective before it was verified (a blocking
        header exchange). The engine calls it before the optimizer changes any shard."""
        self._small.agree(tag)

    def broadcast(self, t: torch.Tensor, src: int, tag: Tag) -> torch.Tensor:
        """Broadcast ``t`` in place from group rank ``src``; returns ``t``."""
        return self._small.broadcast(t, src, tag)

    def all_gather_tensor(self, t: torch.Tensor, tag: Tag) -> torch.Tensor:
        """Every rank's ``t`` (same size everywhere), stacked: shape ``(world, t.numel())``."""
        return self._small.all_gather_tensor(t, tag)

    def all_gather_digest(self, t: torch.Tensor, tag: Tag) -> torch.Tensor:
        """Every rank's ``t``, a tensor of `DIGEST` int64 values, stacked ``(world, DIGEST)``: one
        collective with no header exchange (its size is the same on every rank by construction, so it
        cannot be mismatched in size; a caller that finds the rows differ must go on through a
        verified collective, which names a divergence)."""
        return self._small.all_gather_digest(t, tag)

    def gather_to_rank0(self, t: torch.Tensor, tag: Tag) -> torch.Tensor | None:
        """Every rank's ``t`` stacked on group rank 0 (``(world, t.numel())``); None elsewhere."""
        return self._small.gather_to_rank0(t, tag)

    def exchange_objects(self, obj: Any, tag: Tag) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (needs no numpy, unlike torch's object
        collectives)."""
        return self._small.exchange_objects(obj, tag)

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
                raise rebuild_error(self.global_rank(r), *desc)
        return [p for p, _ in items]


def _reduce_impl(config: CommSettings, backend: str, gather_impl: str) -> str:
    """``auto``: on gloo, through shared memory where the gathers are (shared_reduce.py), else
    pairwise (gloo's collectives measured ~2x slower than pairwise messages); the backend's
    reduce-scatter elsewhere. An explicit ``shm`` where it cannot work is refused."""
    if config.reduce_impl == "shm":
        if gather_impl != "shm":
            raise ZeroConfigError("reduce_scatter_impl='shm' passes gradient parts through shared memory inside the "
                                  "steps' shared-memory window, which only shared-memory gathers open; here "
                                  f"allgather_impl resolves to {gather_impl!r}: set allgather_impl to 'shm' or "
                                  "'auto', or use reduce_scatter_impl 'p2p'")
        if config.quantize_gradients:
            raise ZeroConfigError("reduce_scatter_impl='shm' moves exact gradient parts and zero_quantized_gradients "
                                  "asks for int8/int4 ones on the wire: choose one")
        return "shm"
    if config.reduce_impl != "auto":
        return config.reduce_impl
    if backend != "gloo":
        return "reduce_scatter"
    return "shm" if gather_impl == "shm" and not config.quantize_gradients else "p2p"


def _gather_impl(config: CommSettings, backend: str, nodes: Sequence[int]) -> str:
    """``auto``: on gloo, shared memory when every rank is on one node and no ZeRO++ wire coding
    asks for the wire (else pairwise); the backend's all-gather elsewhere. An explicit ``shm``
    where it cannot work is refused."""
    one_node = len(set(nodes)) == 1 and shared_memory_available()
    if config.allgather_impl == "shm":
        if backend not in ("gloo", "none"):
            raise ZeroConfigError(f"allgather_impl='shm' reads CPU shards from shared memory; the {backend} backend "
                                  "moves device tensors: use 'auto', 'all_gather' or 'p2p'")
        if not shared_memory_available():
            raise ZeroConfigError("allgather_impl='shm' needs Linux's /dev/shm, os.preadv and os.posix_fallocate, "
                                  "which this host lacks: use 'auto' or 'p2p'")
        if not one_node:
            raise ZeroConfigError(f"allgather_impl='shm' needs every rank on one node, but the ranks' nodes are "
                                  f"{list(nodes)}: use 'auto' (shared memory where it can) or 'p2p'")
        if config.quantize_weights:
            raise ZeroConfigError("allgather_impl='shm' moves exact shards and zero_quantized_weights asks for int8 "
                                  "ones on the wire: choose one")
        if config.hpz_partition_size != 1:
            raise ZeroConfigError(f"allgather_impl='shm' reads every shard in place and zero_hpz_partition_size="
                                  f"{config.hpz_partition_size} asks for a secondary copy gathered on the wire within "
                                  "its group: choose one (on one node, where shared memory works, hpZ saves nothing)")
        return "shm"
    if config.allgather_impl != "auto":
        return config.allgather_impl
    if backend != "gloo":
        return "all_gather"
    return "shm" if one_node and not config.quantize_weights and config.hpz_partition_size == 1 else "p2p"
