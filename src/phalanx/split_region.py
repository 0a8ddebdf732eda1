"""Where a tensor-parallel forward holds slices of its activations, for the keyed draws of
`phalanx.random`.

Between a colwise layer and the rowwise one, each process of a tensor group holds a slice of the
activations: the features of the last dimension, or, in an attention module whose heads are
split, the heads of the second dimension of (samples, heads, ...) tensors. A dropout there draws
for the elements of the whole tensor that its slice holds, so its masks are one process's. The
tensor strategy's hooks on the split layers open and close the region as the forward runs
(`Split`); `cut` and `layout` say how a tensor drawn on there is a slice of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (the dimension of x that is sliced, the number of slices, this process's)
Cut = tuple[int, int, int]
# where a sample's elements are a slice of a larger sample's: the whole sample's shape, the
# dimension sliced, the slice's start and length
Layout = tuple[tuple[int, ...], int, int, int]


@dataclass(frozen=True)
class Split:
    """A region of the forward where activations are split over a tensor group of `parts`
    processes, this one `index`: its slice of the last dimension holds `features` of them; `heads`,
    in a split attention, its heads; `sequence`: a sequence norm's output, split by position (a
    DTensor), which no mask follows. `where` says where, for errors."""

    parts: int
    index: int
    where: str
    features: int = 0
    heads: int | None = None
    sequence: bool = False


_region: Split | None = None


def open_split(split: Split) -> None:
    """A split layer's forward ended: the activations from here are split as `split` says."""
    global _region
    _region = split


def close_split() -> None:
    """The layer that takes split activations (rowwise) starts, or a forward starts: they are
    whole."""
    global _region
    _region = None


def region() -> Split | None:
    """The split region the forward runs in now (None: activations are whole)."""
    return _region


def enter(split: Split | None) -> Split | None:
    """Run in `split` from here (a recomputed forward, in its forward's region); returns the region
    it replaces, to enter again after."""
    global _region
    before, _region = _region, split
    return before


def cut(x: torch.Tensor, name: str) -> Cut | None:
    """How `x`, drawn on at `name`, is a slice of what one process would hold: None where it is
    whole. One error where it is split in a way no mask can follow."""
    split = _region
    if split is None:
        return None
    if split.sequence:
        raise RuntimeError(
            f"per-sample dropout at {name!r} runs {split.where}, on this process's share of the "
            "sequence positions, which its masks cannot follow; move the dropout after the "
            "colwise layer that gathers them, or set per_sample_random: false"
        )
    if split.heads is not None and x.dim() == 4 and x.shape[1] == split.heads:
        return (1, split.parts, split.index)
    if x.dim() >= 2 and x.shape[-1] == split.features:
        return (x.dim() - 1, split.parts, split.index)
    heads = "" if split.heads is None else f", nor its second the {split.heads} heads"
    raise RuntimeError(
        f"per-sample dropout at {name!r} runs {split.where}, where this process holds a slice of "
        f"the activations, on a tensor of shape {tuple(x.shape)} whose last dimension is not the "
        f"{split.features} features it holds{heads}: its masks cannot follow one process's; "
        "move the dropout after the rowwise layer, or set per_sample_random: false"
    )


def layout(x: torch.Tensor, dim: int, channels: bool, cut: Cut) -> Layout | None:
    """The `Layout` of a sample's elements of x (samples in `dim`; per channel where `channels`)
    cut as `cut` says; None where the cut dimension is not among them (a channel's mask)."""
    sliced, parts, index = cut
    dims = [i for i in range(x.dim()) if i != dim][: 1 if channels else None]
    if sliced not in dims:
        return None
    whole = [int(x.shape[i]) for i in dims]
    at = dims.index(sliced)
    length = whole[at]
    whole[at] = length * parts
    return tuple(whole), at, index * length, length
