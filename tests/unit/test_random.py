"""Dropout masks keyed by sample (phalanx.random): a sample's mask is a function of the seed, the
step, its index, the module and the draw, whichever forward it sits in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx import random, split_region
from phalanx.random import Draws, drawing

pytestmark = pytest.mark.timeout(120)


def _masks(samples: list[int], step: int = 3, name: str = "net.1", shape=(6, 5)) -> torch.Tensor:
    """The kept elements (0 or 1) of a dropout of rate 0.5 over ones, one row per sample."""
    with drawing(Draws(7, step, samples)):
        out = random.dropout(torch.ones(len(samples), *shape), 0.5, name=name)
    return (out != 0).to(torch.int8)


def test_a_samples_mask_is_the_same_in_a_batch_of_one_of_five_and_padded():
    alone = _masks([12])
    five = _masks([3, 40, 12, 7, 9])
    padded = _masks([12, -1, -1])  # a pipeline's micro-batch: padding rows after the real one
    assert torch.equal(alone[0], five[2]) and torch.equal(alone[0], padded[0])
    # and it is the same on the step's every forward: the draw does not depend on the order
    assert torch.equal(five[0], _masks([3])[0])


def test_masks_differ_between_samples_steps_modules_draws_and_from_padding():
    base = _masks([12, 13])
    assert not torch.equal(base[0], base[1])
    assert not torch.equal(base[0], _masks([12], step=4)[0])
    assert not torch.equal(base[0], _masks([12], name="net.2")[0])
    padded = _masks([-1])
    assert not torch.equal(base[0], padded[0])
    with drawing(Draws(7, 3, [12])):  # the same module twice in one forward: two masks
        first = random.dropout(torch.ones(1, 6, 5), 0.5, name="net.1")
        second = random.dropout(torch.ones(1, 6, 5), 0.5, name="net.1")
    assert torch.equal((first != 0)[0], base[0].bool()) and not torch.equal(first, second)


def test_the_keep_rate_is_one_minus_p_and_kept_values_are_scaled():
    with drawing(Draws(0, 0, list(range(1000)))):
        out = random.dropout(torch.ones(1000, 1000), 0.3, name="x")
    kept = (out != 0).double().mean().item()
    assert abs(kept - 0.7) < 0.01 * 0.7  # 10**6 draws
    assert torch.allclose(out[out != 0], torch.full_like(out[out != 0], 1 / 0.7))


def test_the_bits_are_the_mix_of_their_counters_on_any_device():
    """The same integers, element by element, from Python ints and from tensors: what a GPU's
    int64 arithmetic computes too."""
    values = [0, 1, 2**31, 2**32 - 1, 123456789]
    mixed = random._mix(torch.tensor(values, dtype=torch.int64))
    assert mixed.tolist() == [random._mix_int(v) for v in values]
    keys = random.sample_keys(5, 9, torch.tensor([0, 1, 2**40, -1]))
    assert keys.min() >= 0 and keys.max() < 2**32 and len(set(keys.tolist())) == 4


def test_an_elements_keys_are_kept_unchanged_and_give_the_bits_they_gave_computed(monkeypatch):
    """A site's element keys are kept between steps (a draw's operations halve): the bits from kept
    keys are those computed afresh, a draw does not change the kept keys, and what is kept stays
    within its budget (beyond it the keys are computed each time)."""
    monkeypatch.setattr(random, "_kept", {})
    monkeypatch.setattr(random, "_kept_bytes", {})
    monkeypatch.setattr(random, "_KEPT_BYTES", 8 * 30)
    samples = random.sample_keys(5, 9, torch.tensor([3, 40, 12]))
    site = random._site("net.1", 0)
    element = random._mix(random._mix(torch.arange(30, dtype=torch.int64)) ^ site)
    want = random._mix(samples[:, None] ^ element[None, :])
    first = random.bits(samples, site, 30)
    kept = random._kept[(site, 30, samples.device, None)].clone()
    assert torch.equal(first, want) and torch.equal(random.bits(samples, site, 30), want)
    assert torch.equal(random._kept[(site, 30, samples.device, None)], kept)
    # over the budget: computed, not kept, the same bits
    other = random._site("net.2", 0)
    assert torch.equal(random.bits(samples, other, 30), random.bits(samples, other, 30))
    assert list(random._kept) == [(site, 30, samples.device, None)]
    assert random._kept_bytes[samples.device] == 8 * 30


def _dropped(cases) -> list[torch.Tensor]:
    """Each case's dropout module over a random input of its shape (float64 or float32, gradients
    on), then its output and its input's gradient: fresh draws of one forward of 3 samples."""
    torch.manual_seed(0)
    got = []
    with drawing(Draws(7, 3, [3, 40, 12])):
        for module, shape, dtype in cases:
            random.key_modules(module)
            x = torch.randn(*shape, dtype=dtype, requires_grad=True)
            out = module(x if module.inplace is False else x * 1.0)
            out.backward(torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out))
            got += [out.detach(), x.grad]
    return got


_CASES = [  # samples first: one compiled function; second, or in place: a compiled mask
    (nn.Dropout(0.5), (3, 4, 5, 6), torch.float64),
    (nn.Dropout(0.1), (3, 7), torch.float32),
    (nn.Dropout2d(0.3), (3, 4, 5, 6), torch.float64),
    (nn.Dropout(0.2), (5, 3, 4), torch.float64),  # sequence first
    (nn.Dropout(0.4, inplace=True), (3, 2, 6), torch.float32),
]


def test_dropout_compiled_on_a_gpu_gives_the_eager_outputs_and_gradients(monkeypatch):
    """On a GPU each draw runs compiled (the eager hash moves a dozen int64 tensors of the draw's
    size through memory): the forward and backward as one function where the samples come first,
    else the mask alone. Their outputs and gradients are the eager ones, bit for bit, over shapes,
    rates and dtypes that change between draws; compiled here on the CPU by the same path, into
    scalar C++ (vectorised, the compiler first builds and runs a probe for each instruction set
    the CPU lists: most of a cold compile's time)."""
    import torch._inductor.config

    eager = _dropped(_CASES)
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", False)
    monkeypatch.setattr(random, "_FUSED_ON", ("cpu",))
    for name, function in [
        ("_fused_mask", random._mask_eagerly),
        ("_fused_drop", random._dropped_eagerly),
    ]:
        monkeypatch.setattr(random, name, random._Fused(function))
    fused = _dropped(_CASES)
    for kind in (random._fused_mask, random._fused_drop):
        assert kind.usable and kind._compiled is not None
    assert all(torch.equal(a, b) for a, b in zip(fused, eager, strict=True))


def test_a_device_torch_cannot_compile_for_draws_eagerly_and_says_so_once(monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError("Found no working Triton installation\nsecond line")

    eager = _dropped(_CASES + _CASES)
    monkeypatch.setattr(random, "_FUSED_ON", ("cpu",))
    for name, function in [
        ("_fused_mask", random._mask_eagerly),
        ("_fused_drop", random._dropped_eagerly),
    ]:
        monkeypatch.setattr(random, name, random._Fused(function))
    monkeypatch.setattr(torch, "compile", lambda *a, **k: refused)
    with pytest.warns(
        UserWarning, match=r"eagerly.*\(RuntimeError: Found no working Triton"
    ) as told:
        got = _dropped(_CASES + _CASES)
    assert len(told) == 2  # one for each kind of kernel, the first time
    assert not random._fused_mask.usable and not random._fused_drop.usable
    assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Dropout(0.5)
        self.b = nn.Dropout2d(0.5)
        self.c = nn.AlphaDropout(0.2)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_the_models_dropout_modules_draw_by_sample_and_keep_their_state_and_class():
    net = _Net()
    state = net.state_dict()
    assert random.key_modules(net) == ["a", "b", "c"]
    assert isinstance(net.a, nn.Dropout) and net.state_dict().keys() == state.keys()
    x = torch.randn(4, 3, 5, 5)
    with drawing(Draws(1, 2, [8, 9, 10, 11])):
        whole = net(x)
    with drawing(Draws(1, 2, [10])):
        alone = net(x[2:3])
    assert torch.equal(whole[2:3], alone)
    # Dropout2d drops whole channels: each (sample, channel) plane is all kept or all dropped
    with drawing(Draws(1, 2, [8, 9, 10, 11])):
        planes = net.b(torch.ones(4, 3, 5, 5))
    zero = (planes == 0).flatten(2)
    assert torch.equal(zero.all(-1), zero.any(-1))
    net.eval()
    with drawing(Draws(1, 2, [8, 9, 10, 11])):
        assert torch.equal(net(x), x)  # evaluation draws nothing
    net.train()
    torch.manual_seed(0)
    outside = net.a(torch.ones(2, 8))  # no phalanx forward runs: torch's own draw
    torch.manual_seed(0)
    assert torch.equal(outside, nn.functional.dropout(torch.ones(2, 8), 0.5))


def test_a_sequence_first_input_keys_its_second_dimension_and_another_is_an_error():
    with drawing(Draws(1, 2, [4, 5])):
        seq_first = random.dropout(torch.ones(7, 2, 3), 0.5, name="attn")
    with drawing(Draws(1, 2, [5])):
        alone = random.dropout(torch.ones(7, 1, 3), 0.5, name="attn")
    assert torch.equal(seq_first[:, 1:2], alone)
    with drawing(Draws(1, 2, [4, 5])), pytest.raises(RuntimeError, match="no dimension of"):
        random.dropout(torch.ones(7, 3), 0.5, name="odd")


def test_a_recomputed_forward_draws_the_masks_the_forward_drew():
    """Activation checkpointing runs a forward again in backward: with the draws as they stood, so
    the gradient is that of the masks the forward used."""
    from torch.utils.checkpoint import checkpoint

    def block(x):
        return random.dropout(x, 0.5, name="block") * 2

    x = torch.ones(3, 4, requires_grad=True)
    with drawing(Draws(0, 1, [0, 1, 2])):
        plain = block(x)
    plain.sum().backward()
    want = x.grad.clone()
    x.grad = None
    with drawing(Draws(0, 1, [0, 1, 2])):
        out = checkpoint(block, x, use_reentrant=False, context_fn=random.recomputing)
        random.dropout(torch.ones(3, 4), 0.5, name="block")  # the forward goes on drawing
    out.sum().backward()
    assert torch.equal(out, plain) and torch.equal(x.grad, want)
    # within a region split over a tensor group (the split layers outside the recomputed part),
    # recomputed after the region has closed: the slice's masks again
    x.grad = None
    with drawing(Draws(0, 1, [0, 1, 2])):
        split_region.open_split(split_region.Split(2, 1, "here", features=4))
        out = checkpoint(block, x, use_reentrant=False, context_fn=random.recomputing)
        split_region.close_split()
    out.sum().backward()
    assert torch.equal(x.grad, out.detach())  # 2 / (1 - p) where kept, as the forward's output
    assert not torch.equal(out, plain)  # the second slice's masks, not the first's


class _Drawn(nn.Module):
    """Every way a model draws: a dropout per block (recomputed in backward where checkpointed),
    channels, alpha and in place, one module three times from one tensor (multi-sample dropout),
    and `random.dropout` by name."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.3)) for _ in range(3)
        )
        self.channels = nn.Dropout1d(0.4)
        self.alpha = nn.AlphaDropout(0.2)
        self.inplace = nn.Dropout(0.1, inplace=True)
        self.head = nn.Linear(6, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.channels(x.view(len(x), 3, 2)).view(len(x), 6)
        x = self.inplace(self.alpha(x) * 1.0)
        x = random.dropout(x, 0.25, name="by-hand")
        # weighed apart: two of the three draws swapped would change the output
        return sum((i + 1) * self.head(self.drop(x)) for i in range(3))


def _drawn_run(net, sizes=(8, 8, 5)):
    """Outputs and parameter gradients of steps with these batch sizes (the last one smaller)."""
    got = []
    for step, size in enumerate(sizes):
        x = torch.randn(size, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        with drawing(Draws(3, step, list(range(10 * step, 10 * step + size)))):
            out = net(x)
            grads = torch.autograd.grad(out.sum(), list(net.parameters()))
        got += [out.detach(), *grads]
    return got


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_compiled_model_draws_in_its_graph_the_masks_it_draws_eagerly(checkpointed):
    """Compiled, a model's draws are steps of its graph (no graph break, the where and scaling
    fused with their neighbours), read when the graph runs: compiled once (and again for the last,
    smaller batch), every output and gradient the eager model's (to rounding: the backend
    decomposes some gradients; a mask of its own would be off by a whole unit). The partitioner that
    merges twin operations and recomputes checkpointed ones keeps each draw apart and drawn once."""
    from torch._dynamo.utils import counters

    from phalanx.strategies.base import checkpoint_modules

    torch.manual_seed(0)
    net = _Drawn().double()
    random.key_modules(net)
    eager = _drawn_run(net)
    if checkpointed:
        checkpoint_modules(net, ("Sequential",))
    torch._dynamo.reset()
    counters.clear()
    random.for_compiling()  # as phalanx's `compile` does
    compiled = _drawn_run(torch.compile(net, backend="aot_eager_decomp_partition"))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["frames"]["total"] <= 2, dict(counters["frames"])
    assert all(
        torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(compiled, eager, strict=True)
    )
    # outside phalanx's forwards, the compiled model draws from torch's generator
    out = torch.compile(net.drop, backend="aot_eager_decomp_partition")(torch.ones(4000))
    assert abs((out != 0).double().mean().item() - 0.5) < 0.05 and set(out.tolist()) == {0, 2}


def test_a_compiled_model_computes_its_masks_in_its_graph_from_the_keys_it_reads():
    """Compiled, the only operation the graph cannot see reads the samples' keys and a sample's
    element keys (a few numbers, not a mask of the input's size: the hash, the comparison and the
    where are the graph's, for the compiler to fuse), and a graph traced outside phalanx's steps,
    which takes the first dimension for the samples, says so where they are in another."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    graphs = []

    def keep(gm, example):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    net = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 2))
    random.key_modules(net)
    random.for_compiling()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(net, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    x = torch.randn(5, 7, 6, requires_grad=True)  # the 5 samples first
    got = []
    for run in (net, compiled):
        with drawing(Draws(3, 1, [0, 1, 2, 3, 4])):
            got.append(run(x))
    assert torch.equal(*got)
    drawn = [n for g in graphs for n in g.graph.nodes if "keyed_draw" in str(n.target)]
    shapes = [tuple(v.shape) for n in drawn for v in n.meta["val"]]
    assert len(drawn) == 1 and shapes == [(5,), (7 * 6,)]
    # forwards of other sizes: compiled once more (sizes dynamic), not once for each size
    for size in (4, 3, 2):
        got = []
        for run in (net, compiled):
            with drawing(Draws(3, size, list(range(size)))):
                got.append(run(x[:size]))
        assert torch.equal(*got)
    assert counters["stats"]["unique_graphs"] == 2  # the first sizes, then dynamic ones
    # traced outside a step (samples taken first), run where the samples are second: one error
    torch._dynamo.reset()
    outside = torch.compile(net, backend="aot_eager")
    outside(torch.randn(4, 3, 6))
    with drawing(Draws(3, 1, [0, 1, 2])), pytest.raises(RuntimeError, match="another layout"):
        outside(torch.randn(4, 3, 6))


def test_a_gpu_keeps_a_hundredth_of_its_memory_of_element_keys(monkeypatch):
    """GPT-2-small's 25 dropout sites take 157 MB of element keys, more than 64 MiB: a GPU keeps
    up to a hundredth of its memory, so that no site's keys are computed again every step."""

    class Card:
        total_memory = 80 << 30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Card)
    assert random._keeps(torch.device("cuda", 0)) == (80 << 30) // 100
    assert random._keeps(torch.device("cpu")) == 64 << 20
    Card.total_memory = 2 << 30  # a small card keeps what a CPU keeps
    assert random._keeps(torch.device("cuda", 0)) == 64 << 20


def _sliced(x, index, split):
    """`random.dropout` of `x`, this process's slice `index` in a region split as `split` says (as
    the tensor strategy's hooks open and close it)."""
    split_region.open_split(split(index))
    out = random.dropout(x, 0.5, name="mlp")
    split_region.close_split()
    return out


@pytest.mark.parametrize(
    ("shape", "dim", "split"),
    [
        ((3, 4, 6), 2, lambda i: split_region.Split(2, i, "here", features=3)),  # an MLP's features
        ((4, 3, 6), 2, lambda i: split_region.Split(2, i, "here", features=3)),  # sequence first
        ((3, 4, 5, 5), 1, lambda i: split_region.Split(2, i, "here", features=8, heads=2)),  # heads
    ],
    ids=["features", "sequence-first", "heads"],
)
def test_a_slice_of_activations_split_over_a_tensor_group_draws_its_part_of_the_mask(
    shape, dim, split
):
    """Under tensor parallelism each process holds a slice of the activations between a colwise
    and a rowwise layer: its masks are its slice of the whole tensor's, compiled or not."""
    x = torch.ones(shape)
    with drawing(Draws(1, 2, [5, 6, 7])):
        whole = random.dropout(x, 0.5, name="mlp")
    for run in (_sliced, torch.compile(_sliced, backend="aot_eager")):
        parts = []
        for i, part in enumerate(x.chunk(2, dim)):
            with drawing(Draws(1, 2, [5, 6, 7])):  # a forward of samples 5, 6 and 7
                parts.append(run(part, i, split))
        assert torch.equal(torch.cat(parts, dim), whole)


def test_a_forward_under_tensor_parallelism_starts_whole_after_one_that_raised_in_a_split():
    """The tensor strategy's hooks open a split region after a colwise layer and close it before
    the rowwise one; a forward that raised between them left it open, and the next forward starts
    with its activations whole again."""
    from phalanx.strategies.tensor import _watch_splits

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    _watch_splits(net, {"0": "colwise", "2": "rowwise"}, 2, 0, {})
    seen = []
    net[1].register_forward_pre_hook(lambda module, args: seen.append(split_region.region()))
    boom = net[1].register_forward_hook(lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        net(torch.ones(2, 4))
    assert split_region.region() is not None and seen[-1].features == 4  # left open
    boom.remove()
    net[0].register_forward_pre_hook(lambda module, args: seen.append(split_region.region()))
    net(torch.ones(2, 4))
    assert seen[-2] is None and seen[-1].features == 4 and split_region.region() is None


def test_a_dropout_on_activations_split_in_a_way_no_mask_follows_is_one_error():
    with drawing(Draws(1, 2, [5, 6, 7])):
        split_region.open_split(
            split_region.Split(2, 0, "after the sequence norm 'ln_2'", sequence=True)
        )
        with pytest.raises(RuntimeError, match="at 'mlp' runs after the sequence norm 'ln_2'"):
            random.dropout(torch.ones(3, 4, 6), 0.5, name="mlp")
        split_region.open_split(
            split_region.Split(2, 0, "between 'fc' and 'proj'", features=3, heads=2)
        )
        with pytest.raises(RuntimeError, match=r"shape \(3, 4, 5\) whose last dimension is not"):
            random.dropout(torch.ones(3, 4, 5), 0.5, name="mlp")
    split_region.close_split()
