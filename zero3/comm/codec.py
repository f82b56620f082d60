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

import torch

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
