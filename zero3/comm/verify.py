"""What the verifier needs to verify collectives cheaply: headers, request shapes, plans, failure reports.

[Note: verified collectives]
Ranks must issue the same collectives in the same order with the same sizes: a size mismatch on
gloo returns garbage on one rank and aborts the other (measured), and a rank that stops taking part
leaves the others blocked. So, with ``verify_collectives`` on (the default, on every backend; always
off at world size 1), the communicator (verifier.py) verifies every collective it issues, in one of
two modes per *epoch* (the collectives between two ``engine.step()`` ends, or one inference forward;
an aborted step ends one too, even one that issued no collective, so a rank that catches an exception
and goes on is an epoch ahead and its next header names another step: every rank raises, naming both):

- CHECKED: before each collective the ranks exchange a fixed-size header (`WireHeader`: epoch,
  sequence number, kind, a hash of the parameter ids carried, size) in one blocking all-gather, and
  only issue the data collective when every header agrees. A mismatch raises `ZeroDivergenceError`
  on every rank at once, with each rank's description.
- PLANNED: every epoch's sequence of collective *shapes* (kind, sizes, dtype: a `RequestShape`) is recorded.
  The next epoch that begins with the same request in the same grad mode (`PlanKey`: an inference
  forward's epoch is told from a training one) follows it when every rank agrees, in one header
  exchange at the start of the epoch, on a digest of the same plan. Collectives then carry a 16-byte
  `PayloadHeader` inside their own payload (bit-cast into a gather's input, or as small integers
  in a reduction's extra elements, where every other rank contributes zeros) and are checked when
  they complete: no extra round trip. While every rank follows the plan, every collective has the
  size the plan says on every rank, so nothing can mismatch.

A rank whose next request is not the planned slot (it skipped a layer, or called something the
others did not), or whose epoch ends before the plan does, *leaves the plan in-band*: it issues the
planned slots as dummies with the LEAVING flag set, for slots s .. s+K-1 (K = `WINDOW`), then
switches to CHECKED. Every rank must verify slot s before it issues slot s+K (at most K unverified
collectives in flight), so when any rank sees the first anomaly (a flag, or a header that differs)
at slot s, it has issued at most slots up to s+K-1 too: it issues the rest of them as dummies and
switches as well. All ranks switch after the same slot; everything from slot s on is void and
re-done in CHECKED mode, where a real difference raises on every rank and an identical new order
(every rank skipped the same layer) simply continues. Slots whose first wire collective is a blocking
header exchange (AGREE, broadcast, gathers to rank 0, object exchanges) complete on every rank at
once, so an anomaly there switches right after it.

A rank that stops taking part (returned early, raised in its own code, died) is found by the
timeout of zero3's own process group (``collective_timeout``); the ranks then read, from the
process group's store, what the others reported (`FailureReport`) and name the silent rank.
"""

from __future__ import annotations

import enum
import logging
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

WINDOW = 2
"""K: collectives in flight before the oldest must be verified (gloo runs two at a time per group)."""

HEADER_BYTES = 16
MAGIC = 0x5A
LEAVING = 1
"""Flag: the sender leaves the plan; this slot and the next K-1 are void on every rank."""
VOIDED = 2
"""Flag (header exchange): a request of the sender was issued in a void slot; every rank raises."""

WIRE_WORDS = 8
"""int64 words of a `WireHeader` (the blocking header exchange)."""


class EpochMode(enum.Enum):
    """How the communicator verifies the collectives of the current epoch.

    - IDLE: between epochs; the next request starts one (one blocking header exchange).
    - PLANNED: following an agreed plan; headers ride in the payloads, checked on completion.
    - CHECKED: a blocking header exchange before every collective.
    - BROKEN: a collective timed out or a peer vanished; the group zero3 runs on (its own, or with
      ``collective_timeout`` 0 the user's) is closed and every further collective raises.
    """

    IDLE = enum.auto()
    PLANNED = enum.auto()
    CHECKED = enum.auto()
    BROKEN = enum.auto()


@dataclass(eq=False, slots=True)
class EpochState:
    """Where this rank is in the verified sequence: shared by the verifier (which advances it) and
    the failure monitor (which names the collective that failed and closes the group)."""

    mode: EpochMode = EpochMode.IDLE
    epoch: int = 0
    seq: int = 0  # the next collective's sequence number in this epoch


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The shape of one collective request: what every rank's wire collectives look like."""

    kind: str
    sizes: tuple[int, ...]  # elements of each wire collective's input (header room included)
    dtype: str
    header_first: bool  # its first wire collective is a blocking header exchange
    span: int = 1  # primary shards per piece of a direct gather (hpZ secondary gathers: N, see partition/sharding.py)
    rows: bool = False  # a bucketed gather: one row per rank of each size (header included), not a direct gather's pieces


def content_hash(kind: str, ids: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """32 bits naming what a collective carries: its kind, parameter ids and sizes."""
    return zlib.crc32(repr((kind, ids, sizes)).encode())


def plan_digest(slots: list[RequestShape] | tuple[RequestShape, ...]) -> int:
    """A non-zero 63-bit digest of a plan's shapes (0 means "no plan")."""
    h = zlib.crc32(repr(tuple(slots)).encode())
    return (h << 20 | (len(slots) & 0xFFFFF)) or 1


@dataclass(frozen=True, slots=True)
class PayloadHeader:
    """16 bytes carried inside a planned collective's payload by every rank."""

    epoch: int
    seq: int
    content: int
    flags: int = 0

    def to_bytes(self) -> bytes:
        head = struct.pack("<BBHII", MAGIC, self.flags & 0xFF, self.epoch & 0xFFFF, self.seq & 0xFFFFFFFF,
                           self.content & 0xFFFFFFFF)
        return head + struct.pack("<I", zlib.crc32(head))

    @classmethod
    def from_bytes(cls, raw: bytes) -> PayloadHeader | None:
        """The header, or None when the bytes are not a valid header (garbage)."""
        if len(raw) != HEADER_BYTES or zlib.crc32(raw[:12]) != struct.unpack("<I", raw[12:])[0]:
            return None
        magic, flags, epoch, seq, content = struct.unpack("<BBHII", raw[:12])
        if magic != MAGIC:
            return None
        return cls(epoch=epoch, seq=seq, content=content, flags=flags)


def bitcast_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that hold one header bit for bit (0: the dtype cannot carry one)."""
    size = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool or HEADER_BYTES % size:
        return 0
    return HEADER_BYTES // size


def header_as(dtype: torch.dtype, header: PayloadHeader, device: torch.device) -> torch.Tensor:
    """The header bit-cast into ``bitcast_elements(dtype)`` elements (all-gathers copy bytes)."""
    raw = torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8)
    return raw.view(dtype).to(device)


def headers_from(rows: torch.Tensor) -> list[PayloadHeader | None]:
    """Decode one bit-cast header per row of ``rows`` (shape ``(world, bitcast_elements)``)."""
    raw = rows.detach().contiguous().cpu().view(torch.uint8).reshape(rows.shape[0], HEADER_BYTES)
    return [PayloadHeader.from_bytes(bytes(raw[r].tolist())) for r in range(rows.shape[0])]


def header_values(header: PayloadHeader, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The header as 16 small integers (0..255) of ``dtype``: exact in every float dtype, and a sum
    with zeros (every other rank's contribution to this slot) leaves them unchanged."""
    return torch.tensor(list(header.to_bytes()), dtype=dtype, device=device)


def headers_from_values(rows: torch.Tensor) -> list[PayloadHeader | None]:
    """Decode rows of 16 small integers (the reduction form) into headers."""
    out: list[PayloadHeader | None] = []
    values = rows.detach().float().cpu()
    for r in range(values.shape[0]):
        v = values[r]
        if not bool(torch.isfinite(v).all()) or bool((v != v.round()).any()) or bool(((v < 0) | (v > 255)).any()):
            out.append(None)
            continue
        out.append(PayloadHeader.from_bytes(bytes(int(x) for x in v.tolist())))
    return out


@dataclass(frozen=True, slots=True)
class WireHeader:
    """What a rank is about to do, for the blocking header exchange (8 int64 words)."""

    epoch: int
    seq: int
    kind: int
    content: int
    numel: int
    digest: int = 0  # the plan this rank will follow (epoch start only; 0: none)
    flags: int = 0

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([MAGIC, self.epoch, self.seq, self.kind, self.content, self.numel, self.digest,
                             self.flags], dtype=torch.int64, device=device)

    @classmethod
    def rows(cls, t: torch.Tensor) -> list[WireHeader | None]:
        out: list[WireHeader | None] = []
        for row in t.view(-1, WIRE_WORDS).cpu().tolist():
            out.append(cls(*row[1:]) if row[0] == MAGIC else None)
        return out

    def same_request(self, other: WireHeader | None) -> bool:
        return other is not None and (self.epoch, self.seq, self.kind, self.content, self.numel) == \
            (other.epoch, other.seq, other.kind, other.content, other.numel)


PlanKey = tuple[int, bool]
"""What a plan is looked up by: the content hash of the epoch's first request, and whether grad mode
was on for it. An inference epoch (a ``torch.no_grad()`` forward) starts with the same gather as a
training one; keyed by the request alone, an eval every N steps made the one-successor predictor
mispredict at both ends of each eval (probe 32Q: 8 departures in 24 steps), as the coordinator's
trace key tells the two apart by grad mode too. The key only picks the plan a rank proposes: ranks
follow one only when every rank proposes the same digest, so a key that differed between ranks
would cost a CHECKED epoch, never a wrong collective."""


SUCCESSORS_PER_PLAN = 4
"""What `PlanCache` keeps learnt of which plan followed which: at most this many entries per plan it holds."""


class PlanCache:
    """Recorded epochs (lists of `RequestShape`), keyed by `PlanKey`; a successor predictor picks,
    among plans with one key, the one that followed the previous epoch's plan last time."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._plans: OrderedDict[tuple[PlanKey, int], tuple[RequestShape, ...]] = OrderedDict()  # (key, digest) -> slots
        self._last: dict[PlanKey, int] = {}
        self._successor: dict[tuple[PlanKey, int], int] = {}

    def choose(self, key: PlanKey) -> tuple[tuple[RequestShape, ...], int] | None:
        """The plan to propose for an epoch starting with request ``key``: (slots, digest)."""
        wanted = self._successor.get((key, self._last.get(key, 0)))
        if wanted is not None and (key, wanted) in self._plans:
            return self._plans[(key, wanted)], wanted
        for (k, digest), slots in reversed(self._plans.items()):
            if k == key:
                return slots, digest
        return None

    def record(self, key: PlanKey, slots: list[RequestShape]) -> None:
        if not slots:
            return
        digest = plan_digest(slots)
        learnt = (key, self._last.get(key, 0))
        self._successor.pop(learnt, None)  # most recently learnt last
        self._successor[learnt] = digest
        self._last[key] = digest
        self._plans[(key, digest)] = tuple(slots)
        self._plans.move_to_end((key, digest))
        if len(self._plans) > self.capacity:
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
            # A successor that names an evicted plan is no use, and one learnt from an epoch that never came back
            # (a new order every step) grew by an entry per epoch (probe 37C): those go, least recently learnt
            # first. What followed an evicted plan stays while it names a kept one: an order that comes back
            # is recorded again with the same digest (review 37R2: A X1 A X2 ... predicted A after no X).
            self._successor = {k: d for k, d in self._successor.items() if (k[0], d) in self._plans}
            self._last = {k: d for k, d in self._last.items() if (k, d) in self._plans}
        while len(self._successor) > SUCCESSORS_PER_PLAN * self.capacity:
            del self._successor[next(iter(self._successor))]


class FailureReport:
    """What ranks tell each other through the process group's store when a collective cannot finish.

    A rank posts one line (``post``) when its step is aborted by an exception or when it times out;
    a rank that timed out then reads the others' lines (``read``) to name the silent rank. Uses
    torch's default store; without one (or if it fails), messages just say less.
    """

    def __init__(self, group_name: str, world_size: int, rank: int) -> None:
        self.prefix = f"zero3/{group_name}"
        self.world_size = world_size
        self.rank = rank
        self._store: Any = None
        try:
            import torch.distributed.distributed_c10d as c10d

            self._store = c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: reports are local only
            self._store = None

    def post(self, message: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(f"{self.prefix}/rank{self.rank}", message)
        except Exception:  # noqa: BLE001 - best effort: the store may be gone with the peer that hosted it
            logger.debug("zero3: could not post %r to the store", message)

    def read(self, grace_s: float) -> dict[int, str]:
        """Other ranks' lines, waiting up to ``grace_s`` for every one of them to post."""
        if self._store is None:
            return {}
        out: dict[int, str] = {}
        deadline = time.monotonic() + grace_s
        while True:
            for r in range(self.world_size):
                if r == self.rank or r in out:
                    continue
                key = f"{self.prefix}/rank{r}"
                try:
                    if self._store.check([key]):
                        out[r] = self._store.get(key).decode()
                except Exception:  # noqa: BLE001
                    return out
            if len(out) == self.world_size - 1 or time.monotonic() >= deadline:
                return out
            time.sleep(0.02)
