"""Random numbers keyed by the sample: dropout masks that are a function of the seed, the step, the
sample's index in the dataset, the module that draws and how many times it drew in this forward,
and of nothing else. No process, tower, micro-batch, pipeline stage or copy changes them, so a run
with dropout is the same on any device count.

The draw is a counter-based hash, not a generator with state: each element's 32 random bits are a
keyed integer mix of those counters, computed in one tensor expression on int64 tensors (values
below 2**32, products below 2**63, so no step overflows), the same bits on a CPU and a GPU. A
sample's key mixes the run's seed, the step and its index; an element's, the module's name (its
CRC-32), the draw's number and the element's place within the sample. Padding rows (a pipeline's)
are keyed apart from every real index.

The engine opens a `drawing` context around each forward of a shard of a micro-batch (a pipeline
stage around each chunk it runs); `nn.Dropout` and its kin in the model draw through it once
`key_modules` has set them to, and user code calls `dropout`. Outside such a context (a module run
by hand) they draw as torch does. Activation checkpointing recomputes a forward with the draws it
made (`recomputing`). In a model being compiled the masks are computed by the graph, from the
samples' keys that one operation of it (`keyed_draw`) reads when the graph runs.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
import threading
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from phalanx import split_region
from phalanx.split_region import Cut, Layout, Split

_M32 = 0xFFFFFFFF
# added before mixing a counter: 0 and 1 then differ in many bits
_GOLDEN = 0x9E3779B9
# the two multipliers of the mix are below 2**31: a 32-bit value times one stays below 2**63
_MUL1, _MUL2 = 0x7FEB352D, 0x1B873593
_SALT_SAMPLE, _SALT_SITE = 0x5A3F1C27, 0x2C1B3A95
# of each element's 32 that a dropout compares with its rate
_BITS = 24

_local = threading.local()


def _mix_int(x: int) -> int:
    """A 32-bit integer mix (two multiply-xorshift rounds) of Python ints, as `_mix` of tensors."""
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """`_mix_int`, element-wise on an int64 tensor of values below 2**32 (changed in place)."""
    x ^= x >> 16
    x.mul_(_MUL1).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_MUL2).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def _join_int(key: int, counter: int) -> int:
    return _mix_int(key ^ _mix_int((counter + _GOLDEN) & _M32))


def sample_keys(seed: int, step: int, samples: torch.Tensor) -> torch.Tensor:
    """Each sample's key (int64, below 2**32) at `step`: `samples` holds dataset indices, -1 for
    padding, which no real index shares."""
    base = _SALT_SAMPLE
    for counter in (seed & _M32, (seed >> 32) & _M32, step & _M32, (step >> 32) & _M32):
        base = _join_int(base, counter)
    low = _mix(((samples & _M32) + _GOLDEN) & _M32) ^ base
    high = _mix(((samples >> 32) + 1 + _GOLDEN) & _M32)  # padding: 0; a real index: 1 or more
    return _mix(_mix(low) ^ high)


def _site(name: str, draw: int) -> int:
    """The key of a place that draws: a module's name (or a user's) and its draw in this
    forward."""
    return _join_int(_join_int(_SALT_SITE, zlib.crc32(name.encode())), draw)


def bits(samples: torch.Tensor, site: int, per_sample: int) -> torch.Tensor:
    """Random 32-bit values (int64) of shape (samples, per_sample): sample s's row is a function of
    its key `samples[s]`, the drawing `site` and the column alone."""
    return _mix(samples[:, None] ^ _elements(site, per_sample, samples.device)[None, :])


# each element's key at a site, the same every step: kept, up to this many bytes a device, or this
# share of a GPU's memory where it is more (a draw's own tensor operations then halve, and a site
# not kept costs a GPU a dozen passes over its keys every step: GPT-2-small's 25 sites take 157 MB)
_KEPT_BYTES = 64 << 20
_KEPT_SHARE = 100
_kept: dict[tuple[int, int, torch.device, Layout | None], torch.Tensor] = {}
_kept_bytes: dict[torch.device, int] = {}


def _elements(
    site: int, per_sample: int, device: torch.device, layout: Layout | None = None
) -> torch.Tensor:
    """The keys of a sample's `per_sample` elements at `site` (int64, below 2**32; not to be
    changed: they may be kept): those of elements 0 to per_sample - 1, or, with a `layout`, of the
    elements of the whole sample that this slice holds."""
    key = (site, per_sample, device, layout)
    element = _kept.get(key)
    if element is not None:
        return element
    if layout is None:
        index = torch.arange(per_sample, dtype=torch.int64, device=device)
    else:
        whole, dim, start, length = layout
        index = torch.arange(math.prod(whole), dtype=torch.int64, device=device)
        index = index.view(whole).narrow(dim, start, length).flatten()
    element = _mix(_mix(index) ^ site)
    size = per_sample * element.element_size()
    used = _kept_bytes.get(device, 0)
    if used + size <= _keeps(device):
        _kept[key], _kept_bytes[device] = element, used + size
    return element


def _keeps(device: torch.device) -> int:
    """How many bytes of element keys `device` keeps."""
    if device.type != "cuda":
        return _KEPT_BYTES
    return max(_KEPT_BYTES, torch.cuda.get_device_properties(device).total_memory // _KEPT_SHARE)


class Draws:
    """One forward's draws for the samples of a shard: their dataset indices (-1: padding), the
    seed and the step; each site's number of draws so far."""

    __slots__ = ("seed", "step", "samples", "counts", "_keys", "_before")

    def __init__(self, seed: int, step: int, samples: Sequence[int] | torch.Tensor):
        self.seed, self.step, self.samples = seed, step, samples
        self.counts: dict[str, int] = {}
        self._keys: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def keys(self, device: torch.device) -> torch.Tensor:
        """The samples' keys, on `device` (made at the first draw, then kept)."""
        keys = self._keys
        if keys is None or keys.device != device:
            # not waited for: the host's copy is staged before the call returns
            indices = torch.as_tensor(self.samples, dtype=torch.int64).to(device, non_blocking=True)
            keys = self._keys = sample_keys(self.seed, self.step, indices)
        return keys

    def site(self, name: str) -> int:
        """The next draw of `name` in this forward."""
        draw = self.counts.get(name, 0)
        self.counts[name] = draw + 1
        return _site(name, draw)

    def __enter__(self) -> Draws:
        """`drawing(self)` without its object: the engine enters one every forward."""
        self._before = getattr(_local, "draws", None)
        _local.draws = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.draws = self._before

    def snapshot(self) -> Draws:
        """The same samples, with the counts as they stand (a recomputed forward draws again)."""
        twin = Draws(self.seed, self.step, self.samples)
        twin.counts, twin._keys = dict(self.counts), self._keys
        return twin


class drawing:  # noqa: N801 - a context manager, used as `with drawing(...)`
    """Within it, this thread's keyed draws are those of `draws` (None: torch's own)."""

    __slots__ = ("draws", "_before")

    def __init__(self, draws: Draws | None):
        self.draws = draws

    def __enter__(self) -> Draws | None:
        self._before = getattr(_local, "draws", None)
        _local.draws = self.draws
        return self.draws

    def __exit__(self, *exc: object) -> None:
        _local.draws = self._before


def current() -> Draws | None:
    """This thread's draws, where a forward of phalanx's runs."""
    return getattr(_local, "draws", None)


def recomputing() -> tuple[Any, Any]:
    """For torch.utils.checkpoint's `context_fn`: the forward keeps a copy of the draws as they
    stand, and the recomputation in backward (in whatever thread autograd runs it) draws from that
    copy, in the split region the forward drew in (`split_region`), so it makes the very masks the
    forward made."""
    now = current()
    if now is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _again(now.snapshot(), split_region.region())


class _again(drawing):  # noqa: N801 - a context manager, as `drawing`
    """`drawing(draws)` within the split region `region`, and the one before it back after."""

    __slots__ = ("region", "_region_before")

    def __init__(self, draws: Draws, region: Split | None):
        super().__init__(draws)
        self.region = region

    def __enter__(self) -> Draws | None:
        self._region_before = split_region.enter(self.region)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        split_region.enter(self._region_before)


# --- drawing ----------------------------------------------------------------------------------


def _batch_dim(x: torch.Tensor, n: int, name: str, traced: bool = False) -> int:
    """The dimension of `x` that runs over the forward's `n` samples: the first, or the second (a
    sequence-first layout). `traced`: x is being traced, where a dimension whose size is fixed and
    not n is not the samples', and the other is taken without comparing its size with n, which
    may vary (a graph that compared them would be compiled again for each n); the op checks it
    where the graph runs."""
    sizes = x.shape[:2]
    if traced:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        could = [d for d, size in enumerate(sizes) if not statically_known_true(size != n)]
        if len(could) == 1:
            return could[0]
    if len(sizes) > 0 and sizes[0] == n:
        return 0
    if len(sizes) > 1 and sizes[1] == n:
        return 1
    raise RuntimeError(
        f"per-sample dropout at {name!r}: its input of shape {tuple(x.shape)} has no dimension of "
        f"the forward's {n} samples (the first or the second), so its masks cannot follow the "
        "samples; set per_sample_random: false to draw as torch does"
    )


def _keep(
    x: torch.Tensor,
    p: float,
    name: str,
    channels: bool,
    draws: Draws | None,
    cut: Cut | None = None,
) -> torch.Tensor:
    """A boolean mask of x's shape (broadcastable: per channel where `channels`) keeping each
    element (or channel) with probability 1 - p, keyed by sample; `cut`: x is a slice of the
    tensor one process would hold (`split_region.cut`). `draws` None: a model being compiled,
    whose mask is computed by its graph from the keys that `keyed_draw` reads when it runs."""
    threshold = int(p * (1 << _BITS))
    if draws is None:  # the keys read where the graph runs, the hash in the graph
        n = _traced_samples()  # -1: traced outside phalanx's steps
        dim = 0 if n < 0 else _batch_dim(x, n, name, traced=True)
        shape, per_sample = _per_sample(x, dim, channels)
        cuts = list(cut or ())
        keys, elements = torch.ops.phalanx.keyed_draw(x, name, dim, channels, cuts, _traced())
        keep = _mask_eagerly(keys, elements, threshold)
    else:
        dim = _batch_dim(x, len(draws), name)
        shape, _ = _per_sample(x, dim, channels)
        elements = _site_elements(x, dim, channels, cut, draws, name)
        keep = _mask(draws.keys(x.device), elements, threshold)
    keep = keep.reshape(*shape, *([1] * (x.dim() - len(shape))))
    return keep.movedim(0, dim)


def _site_elements(
    x: torch.Tensor, dim: int, channels: bool, cut: Cut | None, draws: Draws, name: str
) -> torch.Tensor:
    """The element keys of this draw of `name` on x (samples in `dim`; `cut`: x is a slice)."""
    _, per_sample = _per_sample(x, dim, channels)
    layout = None if cut is None else split_region.layout(x, dim, channels, cut)
    return _elements(draws.site(name), per_sample, x.device, layout)


def _per_sample(x: torch.Tensor, dim: int, channels: bool) -> tuple[tuple[int, ...], int]:
    """The shape of x's mask with the samples (in `dim`) first, to the last dimension it draws for
    (a sample's channels where `channels`), and the number of draws a sample."""
    moved = x.movedim(dim, 0)
    shape = tuple(moved.shape[:2] if channels else moved.shape)
    per_sample = 1
    for size in shape[1:]:
        per_sample *= size
    return shape, per_sample


def _mask_eagerly(keys: torch.Tensor, elements: torch.Tensor, threshold: int) -> torch.Tensor:
    """Whether each element of each sample is kept: the top `_BITS` of its 32 random bits (`bits`)
    at or over `threshold`. Eagerly, a dozen passes over an int64 tensor of the draw's size."""
    random = _mix(keys[:, None] ^ elements[None, :])
    return (random >> (32 - _BITS)) >= threshold


def _dropped_eagerly(
    x: torch.Tensor, keys: torch.Tensor, elements: torch.Tensor, threshold: int, scale: float
) -> torch.Tensor:
    """`x` of shape (samples, per_sample, rest) with the elements that `_mask_eagerly`'s mask of
    (samples, per_sample) drops zeroed (over all of `rest`) and the others times `scale`: what
    `_keep` and `_apply` give, in one function."""
    keep = _mask_eagerly(keys, elements, threshold)
    return torch.where(keep[:, :, None], x, 0.0) * scale


class _Fused:
    """`eager` compiled once for every shape, at its first call on a device of `_FUSED_ON`;
    `usable` turns False where torch cannot compile it for the device (no Triton, or a GPU older
    than Triton supports), and the eager function runs, with one warning."""

    def __init__(self, eager: Any) -> None:
        self.eager, self.usable = eager, True
        self._compiled: Any = None

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.usable:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(self.eager, dynamic=True, fullgraph=True)
                return self._compiled(*args)
            except Exception as e:  # noqa: BLE001 - torch's compiler stack raises many kinds
                self.usable = False
                said = str(e).strip().splitlines()[0] if str(e).strip() else ""
                warnings.warn(
                    "per-sample dropout runs eagerly on this device, slower: torch.compile could "
                    f"not build its kernels ({type(e).__name__}: {said})",
                    stacklevel=3,
                )
        return self.eager(*args)


# devices where a draw runs as compiled kernels: on a GPU the eager hash is a dozen passes over an
# int64 tensor of the draw's size (each of a GPT-2-small step's 25 dropouts moved about 5.5 GB
# through memory: BENCHMARKS.md, GPT-2-small on an H200); compiled, the forward reads the input
# and writes the output, and the backward the same, as torch's dropout kernel. Integer arithmetic,
# then the same `where` and product: the same bits. The CPU draws eagerly: a first compile there
# costs more than most CPU runs' dropouts.
_FUSED_ON = ("cuda",)
_fused_mask = _Fused(_mask_eagerly)
_fused_drop = _Fused(_dropped_eagerly)


def _mask(keys: torch.Tensor, elements: torch.Tensor, threshold: int) -> torch.Tensor:
    if keys.device.type in _FUSED_ON:
        return _fused_mask(keys, elements, threshold)
    return _mask_eagerly(keys, elements, threshold)


def _dropout(
    x: torch.Tensor,
    p: float,
    name: str,
    channels: bool,
    inplace: bool,
    draws: Draws | None,
    cut: Cut | None = None,
) -> torch.Tensor:
    """`x` with the elements (or channels) that the samples' masks drop zeroed and the others
    scaled by 1 / (1 - p); in place where `inplace`. On a device of `_FUSED_ON`, an input whose
    samples are its first dimension runs as one compiled function, forward and backward (`draws`
    None, in a model being compiled: the `where` and the product join the model's graph)."""
    scale = 1.0 / (1.0 - p)
    fusable = x.device.type in _FUSED_ON and not inplace and x.numel() and x.is_contiguous()
    if draws is not None and fusable:
        n = len(draws)
        if _batch_dim(x, n, name) == 0:
            elements = _site_elements(x, 0, channels, cut, draws, name)
            threshold = int(p * (1 << _BITS))
            keys = draws.keys(x.device)
            out = _fused_drop(x.view(n, len(elements), -1), keys, elements, threshold, scale)
            return out.view(x.shape)
    return _apply(x, _keep(x, p, name, channels, draws, cut), scale, inplace)


def dropout(
    x: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    name: str | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """`F.dropout`, its mask keyed by sample where a phalanx forward runs (`name`: the place that
    draws, the same in every process; by default the caller's file and line); torch's draw
    elsewhere."""
    if not training or p == 0.0:
        return x
    name = name or _caller()  # compiled, pass `name`: torch.compile cannot read the caller's line
    compiling = torch.compiler.is_compiling()
    draws = None if compiling else current()
    if draws is None and not compiling:
        return F.dropout(x, p, True, inplace)
    if p == 1.0:
        return x.mul_(0.0) if inplace else x * 0.0
    return _dropout(x, p, name, False, inplace, draws, split_region.cut(x, name))


def _apply(x: torch.Tensor, keep: torch.Tensor, scale: float, inplace: bool) -> torch.Tensor:
    if inplace:
        return x.masked_fill_(~keep, 0.0).mul_(scale)
    return torch.where(keep, x, 0.0) * scale


def _caller() -> str:
    frame = sys._getframe(2)  # dropout's caller
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


# SELU's negative saturation, which alpha dropout sets dropped units to
_ALPHA = -1.7580993408473766


def _alpha_dropout(
    x: torch.Tensor, p: float, channels: bool, name: str, draws: Draws | None, cut: Cut | None
) -> torch.Tensor:
    """Alpha dropout (and its feature form): dropped units at SELU's saturation, then an affine map
    that keeps the mean and variance."""
    if p == 1.0:
        return x * 0.0
    keep = _keep(x, p, name, channels, draws, cut)
    a = ((1.0 - p) * (1.0 + p * _ALPHA**2)) ** -0.5
    b = -a * _ALPHA * p
    return torch.where(keep, x, _ALPHA) * a + b


# --- in a compiled model ---------------------------------------------------------------------
# A model being compiled reads its draws through one custom op, opaque to the compiler: when the
# graph runs (not when it is traced, so the step is no guard and the graph is compiled once) it
# hands the graph the samples' keys and the keys of a sample's elements at the draw's site, as the
# eager draw uses them; the mix of the two, the comparison with the rate, the `where` and the
# scaling are the graph's own operations, which the compiler fuses with their neighbours: the mask
# is computed in the kernel that applies it, as torch's dropout draws inside its kernel, and not
# written to memory and read back. The op's result depends on state the graph does not see: it is
# marked random (never merged with a twin, never recomputed in backward) and unsafe to replay as a
# CUDA graph.

_UNSAFE = tuple(
    tag
    for tag in (torch.Tag.nondeterministic_seeded, getattr(torch.Tag, "cudagraph_unsafe", None))
    if tag is not None
)


@torch.library.custom_op("phalanx::keyed_draw", mutates_args=(), tags=_UNSAFE)
def keyed_draw(
    x: torch.Tensor, name: str, dim: int, channels: bool, cut: list[int], call: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the graph runs, the keys of the samples in dimension `dim` of `x` and those of a
    sample's elements (or channels) at this draw of `name` (`_elements`; `cut` empty or a `Cut`),
    int64, copies the graph may reuse; outside phalanx's steps, keys from torch's generator. `call`
    numbers the op's calls in the traced graphs, so that two draws of one module from one tensor
    (multi-sample dropout) are not merged as one."""
    draws = current()
    n = x.shape[dim]
    if draws is None:
        _, per_sample = _per_sample(x, dim, channels)
        return tuple(  # type: ignore[return-value]
            torch.randint(0, 1 << 32, (size,), dtype=torch.int64, device=x.device)
            for size in (n, per_sample)
        )
    if len(draws) != n:
        raise RuntimeError(
            f"per-sample dropout at {name!r}: the compiled model takes dimension {dim} of its "
            f"input of shape {tuple(x.shape)} for the forward's samples, which are {len(draws)}; "
            "it was compiled for inputs of another layout (run it first inside phalanx's steps), "
            "or set per_sample_random: false"
        )
    sliced = (cut[0], cut[1], cut[2]) if cut else None
    elements = _site_elements(x, dim, channels, sliced, draws, name)
    return draws.keys(x.device).clone(), elements.clone()


@keyed_draw.register_fake
def _(
    x: torch.Tensor, name: str, dim: int, channels: bool, cut: list[int], call: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _, per_sample = _per_sample(x, dim, channels)
    keys = x.new_empty((x.shape[dim],), dtype=torch.int64)
    return keys, x.new_empty((per_sample,), dtype=torch.int64)


_calls = itertools.count()


def _traced() -> int:
    """A new number at each call, taken while the graph is traced and kept in it as a constant
    (once `for_compiling` has said so)."""
    return next(_calls)


def _traced_samples() -> int:
    """The number of samples of the forward being traced (-1 outside phalanx's steps), kept in
    the graph as a constant (once `for_compiling` has said so): it says which of the input's
    dimensions holds the samples, which the op checks where the graph runs."""
    draws = current()
    return -1 if draws is None else len(draws)


def for_compiling() -> None:
    """Before a model is compiled: tell torch.compile to take `_traced`'s and `_traced_samples`'
    values as constants (not to guard on them, and compile again at each call). Here, not at
    import: that imports torch's compiler stack, seconds that a run without compile does not
    spend."""
    torch.compiler.assume_constant_result(_traced)
    torch.compiler.assume_constant_result(_traced_samples)


def recompute_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """A selective-checkpoint policy for a compiled model's recomputed modules: the draws' keys are
    kept from the forward (torch.compile takes no other `context_fn` than such a policy's)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.phalanx.keyed_draw.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# --- the model's modules ----------------------------------------------------------------------

_ELEMENTS = (nn.Dropout, nn.AlphaDropout)
_CHANNELS = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout)


def key_modules(module: nn.Module) -> list[str]:
    """Set every dropout module of `module` (torch's Dropout, Dropout1d/2d/3d, AlphaDropout and
    FeatureAlphaDropout) to draw keyed by sample, under its name in `module`: its forward is
    replaced on the instance, so the module tree and its state dict are unchanged. Returns the
    names."""
    if "torch._dynamo" in sys.modules:  # a model that compiles parts of itself
        for_compiling()
    names = []
    for name, sub in module.named_modules():
        if isinstance(sub, _ELEMENTS + _CHANNELS) and "forward" not in vars(sub):
            # on the instance: the module's class and state names stay
            keyed = functools.partial(_keyed_forward, sub, name or "dropout")
            sub.forward = keyed  # type: ignore[method-assign]
            names.append(name)
    return names


def _keyed_forward(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    compiling = torch.compiler.is_compiling()  # then the draws are read when the graph runs
    draws = None if compiling else current()
    p = float(getattr(module, "p", 0.0))
    if (draws is None and not compiling) or not module.training or p == 0.0:
        return type(module).forward(module, x)
    alpha = isinstance(module, (nn.AlphaDropout, nn.FeatureAlphaDropout))
    channels = isinstance(module, _CHANNELS)
    if channels and x.dim() < 3:
        raise RuntimeError(
            f"per-sample dropout at {name!r}: {type(module).__name__} takes batched inputs "
            f"(samples, channels, ...); it got shape {tuple(x.shape)}. Give it a batch, or set "
            "per_sample_random: false"
        )
    cut = split_region.cut(x, name)
    if alpha:
        return _alpha_dropout(x, p, channels, name, draws, cut)
    if p == 1.0:
        return x * 0.0
    return _dropout(x, p, name, channels, bool(getattr(module, "inplace", False)), draws, cut)


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Within it, this thread draws as torch does (a model run outside phalanx's steps)."""
    with drawing(None):
        yield
