"""A small CNN for 8x8 digit images. forward takes the batch keys it names and returns a dict of
named outputs with a per-sample `loss`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(
        self, channels: int = 32, hidden: int = 128, dropout: float = 0.2, classes: int = 10
    ):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 16, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, image: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.features(image))
        return {"logits": logits, "loss": F.cross_entropy(logits, label, reduction="none")}
