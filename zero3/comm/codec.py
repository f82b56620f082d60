"""Blockwise quantization for the wire (ZeRO++'s qwZ and qgZ), in plain torch: CPU and GPU alike.

A tensor of n elements is cut into blocks of ``block`` elements (the last one shorter); each block
is scaled by its largest magnitude so it spans the integer range, rounded to the nearest integer,
and sent as int8 values (or int4 values packed two to a byte) plus one fp32 scale per block. The
receiver multiplies back. The error per element is at most half a step: ``absmax / 254`` for int8,
``absmax / 14`` for int4, of its block. Nothing accumulates: every value is quantized once, by its
sender, and dequantized once, before any sum (so a reduction adds dequantized values in full
precision).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..partition.param import ZeroParameter, alloc_full, raw_data
from .wire import piece

LEVELS = {8: 127, 4: 7}
"""Largest integer magnitude per bit width (symmetric: -L..L)."""


def blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def value_bytes(numel: int, bits: int) -> int:
    """Bytes a message gives the values of ``numel`` elements: one per element (int8) or one per two
    (int4), rounded up to a multiple of 4 so the fp32 scales that follow start 4-byte aligned (torch
    views bytes as float32 only at aligned offsets)."""
    values = numel if bits == 8 else -(-numel // 2)
    return -(-values // 4) * 4


def wire_bytes(numel: int, block: int, bits: int) -> int:
    """Bytes one quantized piece of ``numel`` elements takes in a message: `value_bytes`, then the scales."""
    return value_bytes(numel, bits) + 4 * blocks(numel, block)


def quantize(x: torch.Tensor, block: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: int8 values (int4 packed in pairs into uint8 for ``bits=4``) and one fp32
    scale per block of the flat ``x``."""
    if bits not in LEVELS:
        raise ValueError(f"quantization bits must be 8 or 4, got {bits}")
    flat = x.reshape(-1).float()
    n = flat.numel()
    nb = blocks(n, block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    rows = padded.view(nb, block)
    level = LEVELS[bits]
    scales = rows.abs().amax(dim=1) / level
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-level, level).to(torch.int8).view(-1)[:n]
    if bits == 4:
        q = _pack4(q)
    return q, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, numel: int, block: int, bits: int = 8,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat tensor of ``numel`` elements `quantize` encoded (written into ``out`` when given)."""
    q = _unpack4(values, numel) if bits == 4 else values[:numel]
    nb = blocks(numel, block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=values.device)
    padded[:numel] = q.float()
    result = (padded.view(nb, block) * scales[:, None]).view(-1)[:numel]
    if out is None:
        return result
    out.copy_(result)
    return out


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in -7..7 -> two per byte (low nibble first), as uint8."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).view(-1)[:numel].to(torch.int8)


Layout = list[tuple[int, int, int]]
"""Per tensor of a quantized message: (elements, value bytes, blocks); its bytes are the values
(padded to 4 bytes) then one fp32 scale per block (`wire_bytes`)."""


class QuantizedCodec:
    """ZeRO++'s wire coding of one communicator: qwZ gathers (int8) and qgZ reductions (``grad_bits``),
    blockwise with ``block`` elements per scale. Encodes into and decodes from flat uint8 messages."""

    def __init__(self, block: int, grad_bits: int = 0) -> None:
        self.block = block
        self.grad_bits = grad_bits

    # -- qwZ: parameter shards -------------------------------------------------------------------
    def shard_layout(self, shard_numels: Sequence[int]) -> Layout:
        """The layout of int8-quantized shards of ``shard_numels`` elements."""
        return [(s, value_bytes(s, 8), blocks(s, self.block)) for s in shard_numels]

    @staticmethod
    def size(layout: Layout) -> int:
        return sum(v + 4 * nb for _, v, nb in layout)

    def encode_shards(self, shards: Sequence[torch.Tensor], layout: Layout, payload: torch.Tensor) -> None:
        """Write every shard's int8 values and scales into ``payload`` (uint8), back to back."""
        off = 0
        for shard, (s, v, nb) in zip(shards, layout):
            values, scales = quantize(shard, self.block)
            payload[off: off + s].copy_(values.view(torch.uint8))
            payload[off + v: off + v + 4 * nb].copy_(scales.view(torch.uint8))
            off += v + 4 * nb

    def decode_rows(self, params: Sequence[ZeroParameter], rows: list[torch.Tensor], layout: Layout,
                    span: int = 1) -> None:
        """Write every row's quantized pieces into the parameters' storage. Row q holds, per parameter,
        the pieces of primary ranks ``q * span`` .. ``q * span + span - 1`` (``span`` > 1: the rows of an
        hpZ secondary gather, each a secondary slice of ``span`` primary shards)."""
        for q, row in enumerate(rows):
            off = 0
            for p, (s, v, nb) in zip(params, layout):
                z = p._zero
                full = alloc_full(p) if q == 0 else raw_data(p).view(-1)
                for i in range(span):
                    lo, hi = piece(z.numel, s, q * span + i)
                    if hi > lo:
                        values = row[off: off + s].view(torch.int8)
                        scales = row[off + v: off + v + 4 * nb].view(torch.float32)
                        full[lo:hi].copy_(dequantize(values, scales, s, self.block)[: hi - lo])
                    off += v + 4 * nb

    # -- qgZ: gradient parts ---------------------------------------------------------------------
    def grad_layout(self, shard_numels: Sequence[int]) -> Layout:
        bits = self.grad_bits
        return [(s, value_bytes(s, bits), blocks(s, self.block)) for s in shard_numels]

    def encode_part(self, part: torch.Tensor, payload: torch.Tensor, off: int, v: int, nb: int) -> None:
        """Quantize one gradient part (``grad_bits``) into ``payload`` at ``off``."""
        values, scales = quantize(part, self.block, self.grad_bits)
        payload[off: off + values.numel()].copy_(values.view(torch.uint8))
        payload[off + v: off + v + 4 * nb].copy_(scales.view(torch.uint8))

    def add_row(self, row: torch.Tensor, layout: Layout, out: torch.Tensor) -> int:
        """Add the dequantized parts of one received message to ``out``, in fp32; returns the offset
        of what follows them in ``row``."""
        bits, off, col = self.grad_bits, 0, 0
        for sh, v, nb in layout:
            values = row[off: off + v] if bits == 4 else row[off: off + v].view(torch.int8)
            scales = row[off + v: off + v + 4 * nb].view(torch.float32)
            out[col: col + sh].add_(dequantize(values, scales, sh, self.block, bits))
            off += v + 4 * nb
            col += sh
        return off

