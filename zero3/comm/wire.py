"""What every transport of one communicator shares: its group, device, byte counter and failure
monitor (`Wire`), torch's collectives under the names of every supported version, pairwise works
and profiler labels. Pairwise messages that every transport may need (a direct gather's pieces) and the
object exchange (two all-gathers) are here as well."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..errors import ZeroConfigError
from ..partition.views import byte_view
from .counter import ByteCounter
from .failure import FailureMonitor
from .tags import Kind, Tag
from .verify import HEADER_BYTES, PayloadHeader
from ..metrics import VERIFICATION

META = torch.device("meta")
HEADER_VALUES = 16  # a PayloadHeader as small integers (the reduction form)


# torch 2.13 renamed the flat collectives; keep working on the older names (torch >= 2.4). Looked up at
# each call, so a test can wrap torch.distributed's functions to count bytes independently.
def all_gather_flat(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_flat(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def group_info(group: Any) -> tuple[Any, int, int]:
    """(group, world_size, rank) for a process group, the default group, or no distributed at all."""
    if dist.is_available() and dist.is_initialized():
        g = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(g) if g is not dist.GroupMember.NON_GROUP_MEMBER else -1
        if rank < 0:  # torch answers -1 for a group this rank is not in
            raise ZeroConfigError(
                f"this rank (global rank {dist.get_rank()}) is not a member of the process group given to zero3 "
                "(dist.new_group(ranks) returns GroupMember.NON_GROUP_MEMBER on every rank outside ranks): build "
                "and initialize the model only on the group's ranks, or pass a group this rank belongs to")
        return g, dist.get_world_size(g), rank
    if group is not None:
        raise ZeroConfigError("a process group was given but torch.distributed is not initialized")
    return None, 1, 0


def same_group(a: Any, b: Any) -> bool:
    """Whether two process groups hold the same ranks (None is the default group)."""
    if a is b or not (dist.is_available() and dist.is_initialized()):
        return True
    return group_ranks(a) == group_ranks(b)


def group_ranks(group: Any) -> list[int]:
    """The default-group ranks of ``group`` (None: the default group), in its order; [0] without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def group_alive(group: Any) -> bool:
    """Whether ``group`` (None: the default group) is still registered: ``dist.destroy_process_group()``
    forgets every group, after which torch's collectives on it raise a bare KeyError or ValueError."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def group_name(group: Any) -> str:
    try:
        return str(group.group_name)
    except Exception:  # noqa: BLE001 - a name only for store keys
        return "default"


def piece(numel: int, shard_numel: int, rank: int) -> tuple[int, int]:
    """The real (unpadded) range of a tensor of ``numel`` elements that ``rank`` holds."""
    lo = min(rank * shard_numel, numel)
    return lo, min(lo + shard_numel, numel)


DIRECT_MIN_BYTES = 1 << 20
"""The mean parameter size (bytes) from which a pairwise gather sends one message per parameter and
peer, straight into the parameters' storage. Below it, each message's fixed cost (posting, waiting,
gloo's framing) outweighs the two copies that one row per peer costs (the shards in, the pieces
out), and the bucket travels as rows. Measured on the 4x256 GPT, whose Block buckets average
0.26 MB a parameter, and the 12x768 one (2.4 MB): docs/performance.md, "Holds and rows". (The
same rule for the direct reduction's messages measured slower, and was not kept.) Read at each
call, so a test can move it."""


P2P_TAG_FIRST = 1 << 30
"""zero3's pairwise tags run from 2**30 to 2**31 - 1 and wrap within that range. gloo's tags are
non-negative int32, and a user's own point-to-point messages on the group zero3 runs on
(``collective_timeout: 0``) number theirs from 0 up (torch's default tag is 0): any tag below 2**30
never meets one of zero3's. NCCL ignores tags."""


class PairwiseWork:
    """Point-to-point sends and receives standing for one collective; ``wait()`` waits for all of
    them, then runs ``then`` (e.g. summing what arrived). ``keep`` holds tensors that must live
    until the sends completed; ``headers`` reads every rank's verification header."""

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
            self.keep = self.works = []
            then, self.then = self.then, None  # what it holds (a shared reduction's result) goes with it:
            if then is not None:                # the work itself is kept until the next is issued (probe 38I)
                then()
        return True


@dataclass(eq=False)
class Wire:
    """One communicator's group as its transports see it."""

    group: Any
    world_size: int
    rank: int
    device: torch.device  # where small tensors (headers, flags) live: CUDA for NCCL
    monitor: FailureMonitor
    counter: ByteCounter
    _p2p_tag: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.monitor.global_rank = self.global_rank  # its errors name default-group ranks

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of ``group_rank`` in this group."""
        if self.group is None or self.world_size == 1:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def next_tag(self) -> int:
        """The tag of the next pairwise batch: the same on every rank (the sequence is verified), from
        `P2P_TAG_FIRST` up, clear of the tags of a user's own messages on the same group (gloo matches
        a message by peer and tag)."""
        self._p2p_tag = (self._p2p_tag + 1) % P2P_TAG_FIRST
        return P2P_TAG_FIRST + self._p2p_tag

    def send_recv(self, ops: list[Any], tag: Tag | None, then: Any = None) -> PairwiseWork:
        """Post ``ops`` (`dist.P2POp`s) in one batch."""
        return PairwiseWork(self.monitor.blocking(lambda: dist.batch_isend_irecv(ops), tag) if ops else [], then)

    def p2p(self, op: Any, t: torch.Tensor, peer: int, tag: int) -> Any:
        """One message of a batch, to or from group rank ``peer``."""
        return dist.P2POp(op, t, self.global_rank(peer), self.group, tag)

    def exchange_pieces(self, kind: Kind, mine: Sequence[torch.Tensor], into: Sequence[torch.Tensor],
                        numels: Sequence[int], header: PayloadHeader | None, tag: Tag | None,
                        span: int = 1) -> PairwiseWork:
        """Post the pairwise messages of a direct gather: for every tensor of ``numels``, this rank's
        real piece from ``mine[i]`` to every peer, and every peer's piece into its range of ``into[i]``;
        then the header, if any. A piece is ``span`` primary shards of ``ceil(n / (span * world))``
        elements (1: this group's own shards). The work's ``headers`` reads every rank's header."""
        w, r = self.world_size, self.rank
        t = self.next_tag()
        ops = []
        for q in range(w):
            if q == r:
                continue
            for src, dst, n in zip(mine, into, numels):
                s = span * -(-n // (span * w))
                lo, hi = piece(n, s, r)
                if hi > lo:
                    ops.append(self.p2p(dist.isend, src[: hi - lo], q, t))
                qlo, qhi = piece(n, s, q)
                if qhi > qlo:
                    ops.append(self.p2p(dist.irecv, dst[qlo:qhi], q, t))
                    self.counter.count(kind, q, (qhi - qlo) * dst.element_size(), True)
        got = self._header_messages(ops, header, t)
        work = self.send_recv(ops, tag)
        work.headers = lambda: [header if q == r else PayloadHeader.from_bytes(bytes(got[q].cpu().tolist()))
                                for q in range(w)]
        return work

    def _header_messages(self, ops: list[Any], header: PayloadHeader | None, t: int) -> dict[int, torch.Tensor]:
        """Append a 16-byte header message to and from every peer (none without a header)."""
        got: dict[int, torch.Tensor] = {}
        if header is None:
            return got
        own = torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8).to(self.device)
        for q in range(self.world_size):
            if q != self.rank:
                got[q] = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                ops += [self.p2p(dist.isend, own, q, t), self.p2p(dist.irecv, got[q], q, t)]
                self.counter.count(VERIFICATION, q, HEADER_BYTES, True)
        return got

    def objects(self, obj: Any, kind: Kind | str | None) -> list[Any]:
        """Every rank's picklable ``obj`` (two all-gathers: sizes, then the padded bytes). ``kind``:
        what to count the bytes as (None: not counted, the topology exchange while constructing)."""
        data = pickle.dumps(obj)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        mine_size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.monitor.blocking(lambda: all_gather_flat(sizes, mine_size, group=self.group), None)
        sizes = sizes.cpu()
        longest = max(1, int(sizes.max()))
        mine = torch.zeros(longest, dtype=torch.uint8, device="cpu")  # pickled bytes: never the default device
        byte_view(mine)[: len(data)] = data
        rows = torch.empty(self.world_size * longest, dtype=torch.uint8, device=self.device)
        mine_dev = mine.to(self.device)
        self.monitor.blocking(lambda: all_gather_flat(rows, mine_dev, group=self.group), None)
        if kind is not None:
            self.counter.peers(kind, 8 + longest)
        rows = rows.view(self.world_size, longest).cpu()
        return [pickle.loads(bytes(byte_view(rows[r])[: int(sizes[r])])) for r in range(self.world_size)]


class label:
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
