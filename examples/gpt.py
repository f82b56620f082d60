"""A small GPT (pre-LN blocks, tied input/output embeddings), nanoGPT-style, for examples and tests.

Initialisation follows GPT-2: ``apply(_init_weights)`` then a scaled normal init of every residual
projection. Under ``zero3.Init`` both run on partitioned parameters (zero3 gathers around them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import zero3.checkpointing


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    checkpoint: str | None = None  # None, "reentrant", "non_reentrant", "selective" (torch's) or "zero3": per block
    n_experts: int = 0  # > 0: every block's MLP is a top-1 mixture of this many expert MLPs (MoE)


def _save_matmuls() -> tuple:
    """Selective activation checkpointing: keep the matmuls' outputs, recompute everything else."""
    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                                 torch.ops.aten.bmm.default])


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class MoE(nn.Module):
    """Top-1 mixture of experts: a router sends each token to one expert MLP, scaled by its gate.

    Experts that receive no token are not called, so ranks whose tokens route differently run
    different modules: under zero3 make this a leaf module (``zero3.set_leaf_modules(model, [MoE])``).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList([MLP(cfg) for _ in range(cfg.n_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gate, choice = F.softmax(self.router(flat), dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if bool(mask.any()):
                out = out.index_put((mask,), expert(flat[mask]) * gate[mask].unsqueeze(-1))
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            if self.cfg.checkpoint == "zero3":
                x = zero3.checkpointing.checkpoint(block, x)
            elif self.cfg.checkpoint is not None and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.cfg.checkpoint == "reentrant",
                               **({"context_fn": _save_matmuls} if self.cfg.checkpoint == "selective" else {}))
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def synthetic_batch(step: int, batch: int, cfg: GPTConfig, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of token ids and next-token targets (the same on every rank)."""
    g = torch.Generator().manual_seed(seed + step)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]
