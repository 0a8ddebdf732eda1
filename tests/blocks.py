"""A tiny transformer-like language model laid out as most are: embeddings, its blocks in an
`nn.ModuleList` (or an `nn.Sequential`), a final norm and a head. Importable from configs as
`blocks.X`, for toy.Sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm residual block: a causal mix along the sequence (a running mean), then an MLP."""

    def __init__(self, width: int = 8, dropout: float = 0.0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device)[:, None]
        h = h + self.drop(self.mix(self.norm1(h)).cumsum(dim=1) / steps)
        return h + self.drop(self.mlp(self.norm2(h)))


class TinyTransformer(nn.Module):
    """forward(tokens, labels) -> {"logits", "loss" (per sample, over its real tokens)}.
    `sequential`: the blocks in an nn.Sequential called as one, instead of an nn.ModuleList looped
    over. `tied`: the head shares the embedding's weight."""

    def __init__(
        self,
        vocab: int = 5,
        width: int = 8,
        layers: int = 3,
        dropout: float = 0.0,
        sequential: bool = False,
        tied: bool = False,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        blocks = [Block(width, dropout) for _ in range(layers)]
        self.blocks = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(tokens)
        if isinstance(self.blocks, nn.Sequential):
            h = self.blocks(h)
        else:
            for block in self.blocks:
                h = block(h)
        logits = self.head(self.norm(h))
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # -100: 0
        real = (labels != -100).sum(dim=1).clamp(min=1)
        return {"logits": logits, "loss": losses.sum(dim=1) / real}


class Shortcut(TinyTransformer):
    """Calls its blocks' parts directly, past the blocks' own forward (which FSDP's units hook)."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block.mlp(block.norm2(h))
        logits = self.head(self.norm(h))
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        real = (labels != -100).sum(dim=1).clamp(min=1)
        return {"logits": logits, "loss": losses.sum(dim=1) / real}
