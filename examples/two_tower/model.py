"""A review-rating model of two towers: the user's review text and the item's each pass an
embedding, 1-d convolutions and a max-pool into a dense summary; a head rates the pair.

The towers run side by side, layer for layer: `layers` is one chain of blocks, each holding the two
towers' layers at that depth (`Pair`) and passing both towers' activations on, stacked, to the
next. That chain is what `pipeline` cuts into stages (`split: [layers.2]`) and what `placement`
pins to devices by name (`layers.0: cuda:0`, or one tower's half of a block, `layers.1.item`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Convolution(nn.Module):
    """1-d convolution over the words, then tanh: (batch, words, channels) in and out."""

    def __init__(self, channels: int, filters: int, kernel: int):
        super().__init__()
        self.conv = nn.Conv1d(channels, filters, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x.transpose(1, 2))).transpose(1, 2)


class Summary(nn.Module):
    """Max-pool over neighbouring words, then one dense layer over the whole text."""

    def __init__(self, words: int, filters: int, hidden: int):
        super().__init__()
        self.pool = nn.MaxPool1d(2, stride=1)
        self.dense = nn.Linear((words - 1) * filters, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(x.transpose(1, 2))
        return F.relu(self.dense(pooled.flatten(1)))


class Pair(nn.Module):
    """The user tower's layer on `x[:, 0]` and the item tower's on `x[:, 1]`, stacked again."""

    def __init__(self, user: nn.Module, item: nn.Module):
        super().__init__()
        self.user, self.item = user, item

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        user, item = self.user(x[:, 0]), self.item(x[:, 1])
        return torch.stack([user, item.to(user.device)], dim=1)


class Head(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, towers: torch.Tensor) -> torch.Tensor:
        return self.net(towers.flatten(1)).squeeze(1)


class TwoTower(nn.Module):
    def __init__(
        self,
        vocabulary: int = 200,
        words: int = 64,
        dim: int = 64,
        filters: int = 64,
        kernel: int = 3,
        convolutions: int = 3,
        hidden: int = 64,
    ):
        super().__init__()

        def tower(depth: int) -> nn.Module:
            if depth == 0:
                return nn.Sequential(
                    nn.Embedding(vocabulary, dim), Convolution(dim, filters, kernel)
                )
            return Convolution(filters, filters, kernel)

        blocks = [Pair(tower(d), tower(d)) for d in range(convolutions)]
        length = words - convolutions * (kernel - 1)  # the words left after the convolutions
        blocks.append(Pair(Summary(length, filters, hidden), Summary(length, filters, hidden)))
        blocks.append(Head(hidden))
        self.layers = nn.Sequential(*blocks)

    def forward(
        self, user_review: torch.Tensor, item_review: torch.Tensor, rating: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        predicted = self.layers(torch.stack([user_review, item_review], dim=1))
        error = predicted - rating.to(predicted.dtype)
        return {"rating": predicted, "loss": error.square(), "absolute_error": error.abs()}
