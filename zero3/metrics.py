"""Per-step counters. Numbers live here, never in log strings alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCOPES = ("intra", "inter")
"""Where a peer runs: on this rank's node, or on another (comm/topology.py)."""

VERIFICATION = "verification"
"""The `recv_bytes` kind of verification headers: blocking header exchanges and the headers that
ride inside planned collectives (comm/verify.py); the other kinds count payload only."""


@dataclass
class StepMetrics:
    """What one step did. ``engine.last_step_metrics`` holds the last finished step's copy. The
    counters run from one ``engine.step()`` to the next, so they include what happened in between:
    inference forwards, gathers outside a step, and a step that raised (it never reached
    ``engine.step()``)."""

    step: int = 0
    allgather_calls: int = 0
    allgather_numel: int = 0
    allgather_bytes: int = 0
    demand_fetches: int = 0  # parameters gathered on demand (not prefetched)
    prefetched: int = 0  # parameters gathered ahead of use
    prefetch_hits: int = 0  # prefetched parameters that were used
    wasted_prefetches: int = 0  # prefetched parameters released unused
    releases: int = 0
    live_numel: int = 0  # gathered non-persistent elements now (a gauge)
    live_bytes: int = 0
    peak_live_numel: int = 0
    peak_live_bytes: int = 0
    wait_seconds: float = 0.0  # time blocked waiting for parameter gathers
    reduce_wait_seconds: float = 0.0  # time blocked waiting for gradient reductions
    header_seconds: float = 0.0  # time blocked in verification header exchanges
    forward_seconds: float = 0.0  # wall time inside the root module's forwards
    backward_seconds: float = 0.0  # wall time from the first backward hook to the end of backward
    optimizer_seconds: float = 0.0  # wall time of the optimizer step (unscale, clip, step, copy back)
    p2p_recv_bytes: int = 0  # bytes this rank received in pairwise (isend/irecv) messages, exactly
    shared_read_bytes: int = 0  # bytes of peers' shards read from their arenas (comm/shared.py); not in recv_bytes
    shared_reduce_bytes: int = 0  # bytes of gradient parts read from peers' outboxes (comm/shared_reduce.py); not in recv_bytes
    recv_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bytes this rank received, by collective kind (``Kind.value``: "all-gather", "secondary
    all-gather", "gradient reduction", ... and "verification") and by scope ("intra" / "inter" node).
    Pairwise messages count exactly what arrived from each peer; a collective (gloo's all-gather,
    all-reduce, broadcast, ...) counts the logical bytes each peer contributes (an all-gather of n
    bytes per rank: n from every other rank; an all-reduce of n bytes: n from every other rank),
    not what its algorithm moves (docs/multinode.md#byte-accounting)."""
    secondary_bytes: int = 0  # hpZ secondary shards held now (a gauge; dropped when the step ends)
    peak_secondary_bytes: int = 0
    reduce_calls: int = 0
    reduce_numel: int = 0
    reduce_held_bytes: int = 0
    """What the gradient reducer holds now (a gauge): the full gradients queued in its bucket and the
    buffers of the reduction in flight (comm/works.py `held_storages`); 0 at world size 1, where each
    gradient goes straight into its shard's. Not in it: gradients autograd holds before their
    accumulation hook hands them over, and the shared-memory outboxes (a fixed arena per engine)."""
    peak_reduce_held_bytes: int = 0
    peak_gathered_and_reduce_bytes: int = 0
    """The peak of ``live_bytes`` + ``reduce_held_bytes`` at one moment: with the persistent parameters,
    what ``memory_budget`` bounds (docs/config.md)."""
    divergences: int = 0
    persistent_refresh_numel: int = 0  # persistent params re-gathered after the optimizer step
    header_exchanges: int = 0  # blocking verification exchanges (epoch starts, CHECKED collectives, agreements)
    forced_verifies: int = 0  # planned collectives waited early to keep at most K unverified in flight
    plan_departures: int = 0  # times this rank left the agreed collective plan
    anomalies: int = 0  # planned collectives whose headers showed another rank leaving or a mismatch
    dummy_collectives: int = 0  # void planned collectives issued to switch every rank at one point
    nvme_reads_ahead: int = 0  # parameter shards read from NVMe ahead of their all-gather
    nvme_wait_seconds: float = 0.0  # time blocked waiting for parameter shards to arrive from NVMe
    nvme_read_bytes: int = 0  # bytes read from swap files (shards, optimizer state) during the step
    nvme_write_bytes: int = 0  # bytes written to swap files during the step

    def add_live(self, numel: int, nbytes: int) -> None:
        self.live_numel += numel
        self.live_bytes += nbytes
        if self.live_numel > self.peak_live_numel:
            self.peak_live_numel = self.live_numel
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
        if nbytes > 0 and self.live_bytes + self.reduce_held_bytes > self.peak_gathered_and_reduce_bytes:
            self.peak_gathered_and_reduce_bytes = self.live_bytes + self.reduce_held_bytes

    def add_secondary(self, nbytes: int) -> None:
        self.secondary_bytes += nbytes
        if self.secondary_bytes > self.peak_secondary_bytes:
            self.peak_secondary_bytes = self.secondary_bytes

    def add_reduce_held(self, nbytes: int) -> None:
        self.reduce_held_bytes += nbytes
        if self.reduce_held_bytes > self.peak_reduce_held_bytes:
            self.peak_reduce_held_bytes = self.reduce_held_bytes
        if self.live_bytes + self.reduce_held_bytes > self.peak_gathered_and_reduce_bytes:
            self.peak_gathered_and_reduce_bytes = self.live_bytes + self.reduce_held_bytes

    def received(self, kind: str, scope: str | None = None) -> int:
        """Bytes received of ``kind`` (``Kind.value`` or `VERIFICATION`), in ``scope`` or in both."""
        counts = self.recv_bytes.get(kind, {})
        return sum(counts.get(s, 0) for s in SCOPES) if scope is None else counts.get(scope, 0)

    def reset(self, step: int) -> None:
        """Start a new step; the gauges carry over (what is still held stays counted)."""
        live, live_b, secondary, held = self.live_numel, self.live_bytes, self.secondary_bytes, self.reduce_held_bytes
        self.__init__()  # type: ignore[misc]
        self.step = step
        self.live_numel = self.peak_live_numel = live
        self.live_bytes = self.peak_live_bytes = live_b
        self.secondary_bytes = self.peak_secondary_bytes = secondary
        self.reduce_held_bytes = self.peak_reduce_held_bytes = held
        self.peak_gathered_and_reduce_bytes = live_b + held

    def as_dict(self) -> dict:
        return asdict(self)
