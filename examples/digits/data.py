"""scikit-learn's handwritten digits (1,797 8x8 images, shipped inside the package: no download),
split once, with a fixed seed, into train (70%), valid (15%) and test (15%) streams."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Split(Dataset):
    """One stream: items are dicts {"image": 1x8x8 float tensor in [0, 1], "label": class index}."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[i], "label": self.labels[i]}


class Digits:
    def __init__(
        self, split_seed: int = 0, valid_fraction: float = 0.15, test_fraction: float = 0.15
    ):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
        n_valid, n_test = int(len(order) * valid_fraction), int(len(order) * test_fraction)
        parts = {
            "valid": order[:n_valid],
            "test": order[n_valid : n_valid + n_test],
            "train": order[n_valid + n_test :],
        }
        self._streams = {name: Split(images[idx], labels[idx]) for name, idx in parts.items()}

    def streams(self) -> dict[str, Split]:
        return self._streams
