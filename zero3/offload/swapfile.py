"""Swap files and the threads that read and write them, for the NVMe tier (nvme.py).

Swap files are opened with O_DIRECT where the filesystem allows it (reads then measure the drive,
not the page cache, and model state does not crowd the page cache) and unlinked at once, so they
vanish with the process even when it is killed. O_DIRECT needs `ALIGN`-aligned memory, offsets and
lengths: regions and pool spans are aligned, other memory (torch's allocator aligns to 64 bytes) is
copied through a per-thread aligned bounce buffer. Reads and writes run on ``aio_thread_count``
threads (`AsyncIO`); file IO releases the GIL, so they overlap compute on the calling thread.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable

import torch

from ..errors import ZeroConfigError

ALIGN = 4096
"""Bytes: alignment of swap-file regions, pool spans and direct IO (a multiple of any drive's
logical block size)."""

BOUNCE_BYTES = 8 << 20
"""Bytes of each IO thread's aligned bounce buffer, through which unaligned memory is copied."""


def aligned_nbytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def uint8_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 tensor sharing its memory. Like every view the
    swap threads write through, never an inference tensor (made under ``torch.inference_mode()``, a
    rollout's, the threads' in-place writes into it were refused)."""
    with torch.inference_mode(False):
        return t.detach().reshape(-1).view(torch.uint8)


def storage_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """Every byte of ``storage`` as a 1-D uint8 tensor sharing it (never an inference tensor)."""
    with torch.inference_mode(False):
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D uint8 CPU tensor of ``nbytes`` starting at an `ALIGN`-aligned address,
    pinned when asked and CUDA is available. Never an inference tensor: a pool first filled under
    ``torch.inference_mode()`` (a rollout) is written later by the swap threads and by training."""
    with torch.inference_mode(False):
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip: skip + nbytes]


# -- files and threads -----------------------------------------------------------------------------
def check_swap_directories(directories: list[str]) -> None:
    """Make each swap directory and open a file there, before ``initialize`` changes anything, so that every
    rank can raise what one rank's drive refuses (probe 35F: it raised on that rank alone, after the model
    was partitioned, and the others waited in the next collective).

    Raises:
        ZeroConfigError: naming the directory and the drive's error."""
    for directory in directories:
        try:
            SwapFile(directory, "checked by initialize")  # unlinked at once, closed when dropped
        except ZeroConfigError:  # the directory's own refusal (a ValueError too), as it is
            raise
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path (review 38R2)
            raise ZeroConfigError(f"cannot write a swap file in {directory!r}: {getattr(exc, 'strerror', None) or exc}; "
                                  "set an nvme_path on a writable drive") from exc


class SwapFile:
    """One swap file under ``directory``, unlinked as soon as it is opened, O_DIRECT where the
    filesystem allows it. It is carved into fixed regions: each key gets one the first time it is
    written, and every later write of that key goes to the same place."""

    def __init__(self, directory: str, purpose: str) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
        except (OSError, ValueError) as exc:
            raise ZeroConfigError(f"cannot create the swap directory {directory!r} ({purpose}): "
                                  f"{getattr(exc, 'strerror', None) or exc}; set an nvme_path on a writable drive") from exc
        self.path = os.path.join(directory, f"zero3-{os.getpid()}-{purpose}-{uuid.uuid4().hex[:8]}.swap")
        self.purpose = purpose
        self.fd, self.direct = _open(self.path)
        os.unlink(self.path)  # the data lives as long as the descriptor, and no longer
        weakref.finalize(self, os.close, self.fd)
        self._regions: dict[Hashable, tuple[int, int]] = {}
        self.size = 0  # bytes of all regions (what the file holds once every region was written)

    def region(self, key: Hashable, nbytes: int) -> int:
        """The offset of ``key``'s region of ``nbytes`` (allocated on first use, aligned)."""
        got = self._regions.get(key)
        if got is not None:
            assert got[1] == nbytes, f"swap region {key!r} was {got[1]} bytes, now {nbytes}"
            return got[0]
        offset = self.size
        self.size += aligned_nbytes(nbytes)
        self._regions[key] = (offset, nbytes)
        return offset

    def reserve(self, key: Hashable, nbytes: int) -> int:
        """`region`, with its blocks allocated on the drive now (not when first written), so a drive
        too small fails here; raises ``OSError`` (ENOSPC: the drive is full) naming the file."""
        offset = self.region(key, nbytes)
        try:
            os.posix_fallocate(self.fd, offset, aligned_nbytes(nbytes))
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # no fallocate here: first write allocates
                return offset
            raise OSError(exc.errno, f"zero3: reserving {aligned_nbytes(nbytes)} bytes at offset {offset} of the "
                          f"{self.purpose} swap file under {os.path.dirname(self.path)!r} failed: {exc.strerror}. "
                          "A staged optimizer step keeps two regions of every key on the drive; free space there, or "
                          "set offload_optimizer_staged_step=False to write in place (half the drive, no "
                          "rollback)") from exc
        return offset

    @property
    def allocated_bytes(self) -> int:
        """Bytes the drive holds for this file now (its allocated blocks: what was written or reserved,
        second regions and alignment included; filesystem metadata may add a few blocks)."""
        return os.fstat(self.fd).st_blocks * 512

    def transfer(self, write: bool, offset: int, data: torch.Tensor, bounce: torch.Tensor) -> None:
        """Write ``data`` (a 1-D uint8 CPU tensor) at ``offset``, or read into it; blocking."""
        n = data.numel()
        if n == 0:
            return
        if not self.direct:
            self._full(write, data, offset, n)
            return
        done = 0
        if data.data_ptr() % ALIGN == 0:
            done = n - n % ALIGN
            if done:
                self._full(write, data[:done], offset, done)
        while done < n:  # the unaligned part, through the bounce buffer
            k = min(n - done, bounce.numel())
            span = bounce[: aligned_nbytes(k)]
            if write:
                span[:k].copy_(data[done: done + k])
                self._full(True, span, offset + done, span.numel())
            else:
                self._full(False, span, offset + done, k)
                data[done: done + k].copy_(span[:k])
            done += k

    def _full(self, write: bool, data: torch.Tensor, offset: int, need: int) -> None:
        view = _memory(data)
        total = 0
        while total < need:
            try:
                if write:
                    got = os.pwritev(self.fd, [view[total:]], offset + total)
                else:
                    got = os.preadv(self.fd, [view[total:]], offset + total)
            except OSError as exc:
                raise OSError(exc.errno, f"zero3: {'writing' if write else 'reading'} {need} bytes at offset "
                              f"{offset} of the {self.purpose} swap file under {os.path.dirname(self.path)!r} "
                              f"failed: {exc.strerror}") from exc
            if got == 0:
                raise OSError(errno.EIO, f"zero3: the {self.purpose} swap file ended at {offset + total} bytes, "
                              f"{need - total} bytes short of what was written there")
            total += got


def _memory(data: torch.Tensor) -> memoryview:
    """The bytes of a 1-D uint8 CPU tensor as a writable memoryview, without ``Tensor.numpy()`` (which
    marks the storage as never resizable again, and swapping resizes storages). The caller keeps
    ``data`` alive while the view is used."""
    assert data.device.type == "cpu" and data.dtype == torch.uint8 and data.is_contiguous()
    return memoryview((ctypes.c_char * data.numel()).from_address(data.data_ptr())).cast("B")


def _open(path: str) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, flags | direct, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise ZeroConfigError(f"cannot create the swap file {path!r}: {exc.strerror}") from exc
        else:
            probe = aligned_empty(ALIGN)
            probe.zero_()
            try:  # some filesystems accept O_DIRECT at open and refuse the IO
                os.pwritev(fd, [_memory(probe)], 0)
                return fd, True
            except OSError:
                os.close(fd)
                os.unlink(path)
    try:
        return os.open(path, flags, 0o600), False
    except OSError as exc:
        raise ZeroConfigError(f"cannot create the swap file {path!r}: {exc.strerror}") from exc


class AsyncIO:
    """The threads that read and write swap files; every call returns a ``Future``.

    ``then`` runs on the IO thread right after the transfer (releasing the memory that was written).
    Byte counters are cumulative; readers subtract a baseline.
    """

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zero3-io")
        weakref.finalize(self, self._pool.shutdown, False)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.read_bytes = 0
        self.write_bytes = 0

    def read(self, file: SwapFile, offset: int, data: torch.Tensor) -> Future:
        return self._pool.submit(self._run, False, file, offset, data, None)

    def write(self, file: SwapFile, offset: int, data: torch.Tensor, then: Callable[[], Any] | None = None) -> Future:
        return self._pool.submit(self._run, True, file, offset, data, then)

    def _run(self, write: bool, file: SwapFile, offset: int, data: torch.Tensor, then: Callable[[], Any] | None) -> None:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = aligned_empty(BOUNCE_BYTES)
        file.transfer(write, offset, data, bounce)
        with self._lock:
            if write:
                self.write_bytes += data.numel()
            else:
                self.read_bytes += data.numel()
        if then is not None:
            then()
