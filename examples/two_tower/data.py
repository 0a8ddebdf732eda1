"""Review-rating data, generated when the dataset is built (a fixed seed: no download).

Users and items have hidden tastes and traits (vectors of `factors` numbers). Every word of the
vocabulary leans towards some tastes; a user's review text draws its words by how well they match
the user's tastes, an item's by the item's traits. A sample is one (user, item) pair: the user's
text, the item's text, and the rating the user gave, 1 to 5, from how well taste and trait agree,
plus noise. A model that reads both texts can recover the rating; neither text alone says it.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    """One stream: items are dicts {"user_review", "item_review": word ids, "rating": float}."""

    def __init__(self, texts: tuple[torch.Tensor, torch.Tensor], pairs: torch.Tensor, ratings):
        self.user_texts, self.item_texts = texts
        self.pairs, self.ratings = pairs, ratings

    def __len__(self) -> int:
        return len(self.ratings)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        user, item = self.pairs[i].tolist()
        return {
            "user_review": self.user_texts[user],
            "item_review": self.item_texts[item],
            "rating": self.ratings[i],
        }


class Reviews:
    def __init__(
        self,
        users: int = 400,
        items: int = 400,
        vocabulary: int = 200,
        length: int = 64,
        factors: int = 2,
        samples: int = 8000,
        noise: float = 0.25,
        seed: int = 0,
        valid_fraction: float = 0.1,
        test_fraction: float = 0.1,
    ):
        g = torch.Generator().manual_seed(seed)
        words = torch.randn(vocabulary, factors, generator=g)  # what each word leans towards
        tastes = torch.randn(users, factors, generator=g)
        traits = torch.randn(items, factors, generator=g)

        def texts(who: torch.Tensor) -> torch.Tensor:
            odds = torch.softmax(3.0 * who @ words.T, dim=1)  # (who, vocabulary)
            return torch.multinomial(odds, length, replacement=True, generator=g)

        user_texts, item_texts = texts(tastes), texts(traits)
        pairs = torch.stack(
            [
                torch.randint(users, (samples,), generator=g),
                torch.randint(items, (samples,), generator=g),
            ],
            dim=1,
        )
        agreement = (tastes[pairs[:, 0]] * traits[pairs[:, 1]]).sum(1) / factors**0.5
        ratings = 3.0 + 2.0 * torch.tanh(agreement) + noise * torch.randn(samples, generator=g)
        ratings = ratings.clamp(1.0, 5.0)
        n_valid, n_test = int(samples * valid_fraction), int(samples * test_fraction)
        parts = {
            "valid": slice(0, n_valid),
            "test": slice(n_valid, n_valid + n_test),
            "train": slice(n_valid + n_test, samples),
        }
        self._streams = {
            name: Pairs((user_texts, item_texts), pairs[part], ratings[part])
            for name, part in parts.items()
        }

    def streams(self) -> dict[str, Pairs]:
        return self._streams
