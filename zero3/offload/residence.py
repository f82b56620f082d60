"""`ShardStore`: the one writer of parameter shards and of where their bytes are.

[Note: shard residence]
A shard's bytes are in one place at a time (``Residence``, partition/state.py): accelerator memory,
host memory (pinned or not), on their way to or from a swap file, only on the drive, or taken out by
``engine.offload_states``. Every change of the shard tensor (a cast under mixed precision, a view
into the optimizer's flat buffer, a copy to host memory or into pinned memory) and of its bytes (a
pool span pointed at, storage freed or allocated around drive IO, storage taken by offload_states)
is a method here, checked against the table of legal moves before the shard changes, so an illegal
move raises and leaves the shard as it was. The drive tier (nvme.py `ShardTier`), the placement of
shards, the casts and the optimizer's buffers ask for moves; they never write the record.

Writing new *values* into a shard in memory (the optimizer step, ``copy_full_into_shard``) moves
nothing and stays with those writers. How residence meets ``ParamStatus`` is told at `Residence`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import ZeroStateError
from ..partition import sharding
from ..partition.param import ZeroParameter, refresh_api, residence_of
from ..partition.state import ParamStatus, Residence, check_move
from .policy import PlacementPolicy
from .swapfile import storage_view


class ShardStore:
    """The moves of parameter shards (see [Note: shard residence]); one per runtime context."""

    def __init__(self, placement: PlacementPolicy) -> None:
        self.placement = placement
        self._left: dict[int, Residence] = {}  # ZeroParam.id -> where offload_states took the shard from

    # -- memory to memory: the record is rebound to another tensor -------------------------------------
    def rebind(self, p: ZeroParameter, new: torch.Tensor) -> None:
        """Make ``new`` (a cast copy, a copy elsewhere, a view into a flat buffer; the same padded size)
        ``p``'s shard; the record's dtype and residence follow it. Only while ``p`` is not gathered and
        its shard is in memory (a drive shard keeps its tensor: its region is keyed by it)."""
        z = p._zero
        if new.dim() != 1 or new.numel() != z.shard_numel:
            raise ZeroStateError(f"{z.summary()}: a new shard must be 1-D with {z.shard_numel} elements, "
                                 f"got shape {tuple(new.shape)}")
        if z.status is not ParamStatus.NOT_AVAILABLE:
            raise ZeroStateError(f"{z.summary()}: its shard cannot be replaced while it is gathered")
        if not z.residence.in_memory:
            raise ZeroStateError(f"{z.summary()}: its shard is {z.residence.name}; only a shard in memory is replaced")
        where = residence_of(new)
        check_move(z.summary(), z.residence, where)
        z.shard = new
        z.retype(new.dtype)
        z.residence = where
        refresh_api(p)  # the gathered-state API entries must not keep the old shard alive

    def repartition(self, p: ZeroParameter, full: torch.Tensor) -> None:
        """The gathered ``p`` was given full data of another shape (Hugging Face's
        ``resize_token_embeddings`` assigns ``weight.data``): it becomes ``p``'s values, partitioned
        anew. Only for a shard in memory that no optimizer holds (a master, or state keyed by it)."""
        z = p._zero
        if z.status is not ParamStatus.AVAILABLE or not z.residence.in_memory or z.master is not None \
                or z.swap is not None:
            raise ZeroStateError(f"{z.summary()}: only a gathered parameter with its shard in memory and no "
                                 "master can be given another shape")
        z.reshape(full.shape, sharding.shard_tensor(full.detach(), z.world_size, z.rank).to(z.shard.device))
        refresh_api(p)
        p.__dict__.update(ds_shape=z.shape, ds_numel=z.numel)  # set once at partitioning otherwise

    def cast(self, p: ZeroParameter, dtype: torch.dtype) -> None:
        """Mixed precision: the shard becomes its copy in ``dtype``."""
        self.rebind(p, p._zero.shard.to(dtype))

    def place_on_host(self, p: ZeroParameter) -> None:
        """``offload_param="cpu"``: the shard moves to CPU memory, pinned when the policy pins."""
        shard = p._zero.shard
        pin = self.placement.pin_param_shards
        if shard.device.type != "cpu" or (pin and not shard.is_pinned()):
            self.rebind(p, shard.detach().to("cpu").pin_memory() if pin else shard.detach().to("cpu"))

    def pin(self, p: ZeroParameter) -> None:
        """``zero3.Init(pin_memory=True)``: a CPU shard moves into pinned memory (with CUDA)."""
        if p._zero.shard.device.type == "cpu" and torch.cuda.is_available():
            self.rebind(p, p._zero.shard.pin_memory())

    def own_cpu_storage(self, p: ZeroParameter) -> None:
        """Before the shard goes to the drive: it gets a CPU storage of its own and exactly its size
        (the drive tier resizes that storage, which must hold nothing else)."""
        shard = p._zero.shard
        if shard.device.type != "cpu" or shard.storage_offset() != 0 or \
                shard.untyped_storage().nbytes() != shard.numel() * shard.element_size():
            self.rebind(p, shard.detach().to("cpu", copy=True))

    # -- the drive: the same tensor, its bytes moved (driven by nvme.py `ShardTier`) --------------------
    def move(self, p: ZeroParameter, to: Residence | None = None) -> None:
        """Record that ``p``'s bytes are now ``to`` (None: in memory, wherever the shard tensor is)."""
        z = p._zero
        new = residence_of(z.shard) if to is None else to
        check_move(z.name, z.residence, new)
        z.residence = new

    def point(self, p: ZeroParameter, data: torch.Tensor) -> None:
        """DRIVE -> READING into ``data`` (a pool span of the shard's size and dtype): the shard uses its memory."""
        check_move(p._zero.name, p._zero.residence, Residence.READING)
        with torch.no_grad():
            p._zero.shard.set_(data)
        p._zero.residence = Residence.READING

    def allocate(self, p: ZeroParameter, nbytes: int, to: Residence | None = None) -> None:
        """Give the shard's own storage its ``nbytes`` back (to be read into: READING; None: to be
        overwritten whole, in memory)."""
        to = residence_of(p._zero.shard) if to is None else to
        check_move(p._zero.name, p._zero.residence, to)
        p._zero.shard.untyped_storage().resize_(nbytes)
        p._zero.residence = to

    def begin_write(self, p: ZeroParameter) -> tuple[torch.Tensor, Callable[[], None]]:
        """Memory -> WRITING: the bytes of the shard's own storage, and what frees them once they are
        written (run on the IO thread; the shard becomes DRIVE when the write is waited for)."""
        check_move(p._zero.name, p._zero.residence, Residence.WRITING)
        storage = p._zero.shard.untyped_storage()
        p._zero.residence = Residence.WRITING
        return storage_view(storage), lambda: storage.resize_(0)

    def free(self, p: ZeroParameter, to: Residence, from_span: bool) -> None:
        """Give back the memory of the shard's bytes (``from_span``: it points at a pool span, which
        the caller frees; it gets a fresh 0-byte storage of its own) and record them ``to``."""
        z = p._zero
        check_move(z.name, z.residence, to)
        if from_span:
            n = z.shard.numel()
            with torch.no_grad():
                z.shard.set_(torch.UntypedStorage(n * z.shard.element_size(), device=z.shard.device), 0, (n,), (1,))
        z.shard.untyped_storage().resize_(0)
        z.residence = to

    def own_memory(self, p: ZeroParameter) -> None:
        """A shard in a shared-memory arena (comm/shared.py) moves into memory of its own: same
        values, same tensor (the optimizer keeps stepping on it), same residence. A gathered
        parameter's full tensor is apart from its shard, so it may be gathered (persistent ones are)."""
        z = p._zero
        if not z.residence.in_memory:
            raise ZeroStateError(f"{z.summary()}: its shard moves into memory of its own only while it is in memory")
        own = z.shard.detach().clone()
        with torch.no_grad():
            z.shard.set_(own)

    def copy_out_of_span(self, p: ZeroParameter) -> None:
        """A shard read into a pool span moves into memory of its own (same values, same tensor)."""
        z = p._zero
        own = z.shard.detach().clone()
        check_move(z.name, z.residence, residence_of(own))  # before anything changes
        with torch.no_grad():
            z.shard.set_(own)
        self.move(p)

    # -- engine.offload_states -------------------------------------------------------------------------
    def take(self, params: list[ZeroParameter], move_out: Callable[[], None]) -> None:
        """offload_states: ``move_out`` takes the storages of ``params``' shards (in memory) out, and
        they are refused until `give_back`. All are checked before anything moves."""
        for p in params:
            z = p._zero
            if z.status is ParamStatus.INFLIGHT:
                raise ZeroStateError(f"{z.summary()}: offload_states while a gather of it is in flight")
            check_move(z.summary(), z.residence, Residence.STATES_OUT)
        move_out()
        for p in params:
            self._left[p._zero.id] = p._zero.residence
            p._zero.residence = Residence.STATES_OUT

    def give_back(self, params: list[ZeroParameter]) -> None:
        """reload_states brought the storages back: each shard is where it was taken from."""
        for p in params:
            z = p._zero
            check_move(z.summary(), z.residence, self._left[z.id])
        for p in params:
            p._zero.residence = self._left.pop(p._zero.id)
