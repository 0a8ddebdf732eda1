"""Per-sample random streams for the data (`phalanx.seeding`): what a dataset draws in
`__getitem__` from torch, random and numpy depends on (seed, epoch, index) alone, not on the batch,
the rank, the process or the worker that reads the item; and the reader's own generators are left
as they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import toy
from torch.utils.data import Dataset, IterableDataset

import phalanx
from phalanx import data, loading, seeding
from phalanx.hooks import ComputeStats, Hook

pytestmark = pytest.mark.timeout(120)
N = 13


class Draws(Dataset):
    """Items that are what their read drew: one number each from torch, random and numpy."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        drawn = [torch.rand(()).item(), random.random(), float(np.random.rand())]
        return {"i": i, "drawn": torch.tensor(drawn, dtype=torch.float64)}


class BatchedDraws(Draws):
    """Draws with a batched read that draws for all of its items at once, as a batched
    augmentation does."""

    def __getitems__(self, indices: list[int]) -> list[dict]:
        drawn = torch.rand(len(indices), dtype=torch.float64)
        return [{"i": i, "drawn": d.expand(3).clone()} for i, d in zip(indices, drawn, strict=True)]


class SometimesDraws(Draws):
    """Draws from random and numpy only for the items whose torch draw says so: a generator first
    drawn from in a later batch, or only once another is seeded."""

    def __getitem__(self, i: int) -> dict:
        first = torch.rand(()).item()
        more = [random.random(), float(np.random.rand())] if first < 0.3 else [-1.0, -1.0]
        return {"i": i, "drawn": torch.tensor([first, *more], dtype=torch.float64)}


class DrawsOnceSeeded(Draws):
    """Draws from numpy only where torch was seeded for the item: seen only on a batch's second
    reading, which must then be read a third time."""

    def __getitem__(self, i: int) -> dict:
        seeded = torch.initial_seed() == seeding.item_seed(seeding.training_key(0, 1), i)
        more = float(np.random.rand()) if seeded else -1.0
        return {"i": i, "drawn": torch.tensor([torch.rand(()).item(), more, 0.0])}


class StreamOfDraws(IterableDataset):
    """An iterable stream of N items, each what its read drew; its __iter__ shuffles the order of
    the values it gives with random, as a stream that shuffles its files does."""

    def __iter__(self):
        names = list(range(N))
        random.shuffle(names)  # when iter() is called, before the first item is asked for
        return ({"i": name, "drawn": torch.rand(3, dtype=torch.float64)} for name in names)


def drawn(batches) -> dict[int, torch.Tensor]:
    """Each item's draws, by index, from an iterable of batches (None: an empty shard)."""
    out: dict[int, torch.Tensor] = {}
    for batch in batches:
        if batch is not None:
            out.update(zip(batch["i"].tolist(), batch["drawn"], strict=True))
    return out


def read(stream, key, batch=4, world=1, order=None, **options) -> dict[int, torch.Tensor]:
    """Every item of `stream`, read as `world` ranks' loaders read their shards of `batch`."""
    order = list(range(N)) if order is None else order
    out: dict[int, torch.Tensor] = {}
    for rank in range(world):
        plan = data.Plan(order, batch, 1, rank, world)
        out.update(drawn(loading.loader(stream, plan, key=key, **options)))
    return out


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) == list(range(N))
    for i in a:
        assert torch.equal(a[i], b[i]), i


def assert_all_differ(a: dict, b: dict) -> None:
    for i in a:
        assert a[i][0] != b[i][0], i


def defined(stream, key) -> dict[int, torch.Tensor]:
    """Each item read with all three generators seeded from the key and its index: the definition
    that a reader which seeds only the generators a stream draws from must match."""
    batched = getattr(stream, "__getitems__", None)
    items = seeding.read_items(key, range(N), lambda i: batched([i])[0] if batched else stream[i])
    return drawn([{"i": torch.arange(N), "drawn": torch.stack([it["drawn"] for it in items])}])


def generator_states() -> tuple:
    return torch.default_generator.get_state(), random.getstate(), np.random.get_state()


def next_draws() -> tuple:
    return torch.rand(2).tolist(), random.random(), np.random.rand(2).tolist()


@pytest.mark.parametrize(
    "stream", [Draws(), BatchedDraws(), SometimesDraws()], ids=["getitem", "getitems", "sometimes"]
)
def test_an_item_draws_the_same_however_and_wherever_it_is_read(stream):
    epoch1, epoch2 = seeding.training_key(0, 1), seeding.training_key(0, 2)
    alone = read(stream, epoch1, batch=1)
    assert_same(alone, defined(stream, epoch1))
    if isinstance(stream, SometimesDraws):  # both kinds of item, in the first batch or later
        assert {bool(alone[i][1] == -1) for i in range(N)} == {True, False}
    assert_same(read(stream, epoch1, batch=5, order=list(reversed(range(N)))), alone)
    assert_same(read(stream, epoch1, batch=4, world=2), alone)  # two ranks' shards
    assert_same(read(stream, epoch1, batch=3, num_workers=2), alone)  # in DataLoader workers
    fetch = loading.fetcher(stream, key=epoch1)  # a strategy that deals samples out
    assert_same(
        drawn([fetch([3, 7, 0]), fetch([i for i in range(N) if i not in (0, 3, 7)])]), alone
    )

    # persistent workers, pointed at the next epoch's key: the values a fresh read of it gives
    loaders = loading.Loaders(num_workers=2)
    try:
        plan = data.Plan(list(range(N)), 4)
        assert_same(drawn(loaders.loader(stream, plan, key=epoch1, training=True)), alone)
        kept = drawn(loaders.loader(stream, plan, key=epoch2, training=True))
    finally:
        loaders.close()
    assert_same(kept, defined(stream, epoch2))
    assert_all_differ(kept, alone)  # another epoch, other draws
    values = torch.stack([alone[i] for i in range(N)])
    assert len(set(values[:, 0].tolist())) == N  # each item its own


@pytest.mark.parametrize("memcmp", [True, False], ids=["memcmp", "bytes"])
def test_a_draw_from_torch_is_seen_by_comparing_its_state_in_place_or_as_bytes(memcmp, monkeypatch):
    """torch's state is compared where it lies (the C library's memcmp) or, where that is not
    found, as bytes: either way a stream that draws from torch alone is seen to, and read as
    defined."""
    if not memcmp:
        monkeypatch.setattr(seeding, "_MEMCMP", None)
    else:
        assert seeding._MEMCMP is not None  # the C library is found where the tests run
    saved = torch.default_generator.get_state()
    assert seeding._same_torch_state(saved)
    torch.rand(1)
    assert not seeding._same_torch_state(saved)
    key = seeding.training_key(0, 1)
    assert_same(read(BatchedDraws(), key, batch=4), defined(BatchedDraws(), key))


def test_a_generator_drawn_from_only_once_another_is_seeded_is_seeded_too():
    key = seeding.training_key(0, 1)
    want = defined(DrawsOnceSeeded(), key)
    assert all(want[i][1] != -1 for i in range(N))
    assert_same(read(DrawsOnceSeeded(), key, batch=5), want)


def test_reading_leaves_the_readers_generators_as_they_were():
    """The trainer's own draws (dropout, say) do not depend on whether, or how many, items this
    process read: a shard's read, an empty batch's shape, an iterable stream's steps and the first
    samples a hook looks at."""
    state = generator_states()
    want = next_draws()
    for read_some in (
        lambda: read(Draws(), seeding.training_key(0, 1), world=2, empty_batches=True),
        lambda: read(SometimesDraws(), seeding.training_key(0, 1), batch=1),
        lambda: read(BatchedDraws(), seeding.training_key(0, 1)),
        lambda: list(loading.StreamSteps(StreamOfDraws(), 4, key=seeding.stream_key(0, "x"))),
        lambda: loading.first_items(Draws(), 5, seeding.stream_key(0, "train")),  # LogThroughput's
        lambda: loading.first_items(StreamOfDraws(), 5, seeding.stream_key(0, "train")),
    ):
        torch.default_generator.set_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])
        read_some()
        assert next_draws() == want


class FailsAfterDrawing(Draws):
    """Item 2 draws from numpy, then fails, as an augmentation that raises on a bad sample."""

    def __getitem__(self, i: int) -> dict:
        if i == 2:
            np.random.rand()
            raise ValueError("a bad sample")
        return {"i": i, "drawn": torch.zeros(3, dtype=torch.float64)}


@pytest.mark.parametrize("known", [False, True], ids=["first-draw", "known-to-draw"])
def test_a_read_that_fails_leaves_the_readers_generators_as_they_were(known):
    """The error reaches the reader, and the generators are where they were before the batch: in a
    stream not yet seen to draw (its marks compared around the read alone) and in one known to."""
    stream = seeding.Keyed(FailsAfterDrawing())
    key = seeding.training_key(0, 1)
    if known:
        stream.drawn = {"numpy"}
    stream.read([0, 1], key)  # the generators' states kept
    next_draws()
    state = generator_states()
    want = next_draws()
    torch.default_generator.set_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])
    with pytest.raises(ValueError, match="a bad sample"):
        stream.read([0, 1, 2, 3], key)
    assert next_draws() == want


def test_without_a_key_items_draw_from_the_readers_generators():
    """The switch off (per_sample_random: false): plain PyTorch, where the draws depend on what the
    process drew before; the test above could fail."""
    first = read(Draws(), None, batch=1)
    assert not torch.equal(read(Draws(), None, batch=1)[0], first[0])


def test_an_iterable_streams_items_draw_by_their_position_on_any_rank_and_after_a_resume():
    key = seeding.training_key(0, 1)

    def steps(**options) -> dict[int, torch.Tensor]:
        return drawn(
            batch
            for _, micros in loading.StreamSteps(StreamOfDraws(), 4, **options)
            for _, batch in micros
        )

    whole = steps(key=key)
    assert_same(steps(key=key, rank=1, world_size=2) | steps(key=key, world_size=2), whole)
    resumed = steps(key=key, start=2)  # steps 0 and 1 read and dropped
    assert sorted(resumed) == sorted(list(whole)[8:])  # the same order: __iter__ was keyed too
    assert all(torch.equal(resumed[i], whole[i]) for i in resumed)
    assert_all_differ(steps(key=seeding.training_key(0, 2)), whole)


def test_keys_are_distinct_and_do_not_depend_on_the_process():
    assert seeding.training_key(0, 1) != seeding.training_key(0, 2) != seeding.training_key(1, 1)
    assert seeding.stream_key(0, "valid") != seeding.stream_key(0, "test")
    assert seeding.stream_key(0, "train") not in {seeding.training_key(0, e) for e in range(99)}
    # splitmix64's published first output from state 0: the mix is that function, in any process
    # and on any platform, so resumed runs draw what they drew before
    assert seeding.key(0) == 0xE220A8397B1DCDAF
    assert len({seeding.item_seed(7, i) for i in range(10_000)}) == 10_000


class NoisyStream(IterableDataset):
    """Regression items in order, an iterable stream, with noise drawn as each is read."""

    def __init__(self, items: Dataset):
        self.items = items

    def __iter__(self):
        for i in range(len(self.items)):
            item = self.items[i]
            noise = torch.randn(()).item() + random.gauss(0, 1) + float(np.random.randn())
            yield {**item, "x": item["x"] + 0.01 * noise}


class TrainerDraws(Hook):
    """The trainer's own draws between batches, as dropout draws (from all three generators)."""

    gathers = False

    def after_batch(self, stream: str, batch: dict) -> None:
        next_draws()


def trained(streams: dict, per_sample: bool, hooks: list) -> dict[str, torch.Tensor]:
    raw = toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        dataset={"class": "toy.Regression", "batch_size": 7},
        main_loop={"epochs": 2, "extra_streams": ["valid"], "eval_every_n_steps": 4},
        per_sample_random=per_sample,
        hooks=[],
    )
    del raw["dataset"]["class"]
    run = phalanx.fit(raw, dataset=streams, hooks=hooks)
    assert run.code == 0
    return {**run.model.state_dict(), "valid.loss": torch.tensor(run.metrics["valid.loss"])}


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_a_runs_augmentation_does_not_depend_on_what_the_trainer_draws(kind):
    """Training and evaluation streams, map-style and iterable, through the trainer: the same
    parameters and evaluation whether or not the trainer draws between batches."""
    noisy = toy.NoisyRegression(n_train=30).streams()
    plain = toy.Regression(n_train=30).streams()
    streams = noisy if kind == "map" else {k: NoisyStream(v) for k, v in plain.items()}
    want = trained(streams, True, [ComputeStats()])
    got = trained(streams, True, [ComputeStats(), TrainerDraws()])
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    if kind == "map":  # plain PyTorch: the trainer's draws move the augmentation
        off = trained(streams, False, [ComputeStats()])
        moved = trained(streams, False, [ComputeStats(), TrainerDraws()])
        assert not torch.equal(off["valid.loss"], moved["valid.loss"])


class OneGaussian(Draws):
    """Only item 5 draws, and only one Gaussian, from numpy's legacy generator or Python's `random`:
    a draw that may move no twister, served from the Gaussian each library keeps from its last
    pair."""

    def __init__(self, library: str):
        self.gauss = np.random.standard_normal if library == "numpy" else random.gauss

    def __getitem__(self, i: int) -> dict:
        more = float(self.gauss()) if i == 5 else 0.0
        return {"i": i, "drawn": torch.tensor([0.0, more, 0.0], dtype=torch.float64)}


class Nothing(Draws):
    def __getitem__(self, i: int) -> dict:
        return {"i": i, "drawn": torch.zeros(3, dtype=torch.float64)}


@pytest.mark.parametrize("cached", [False, True], ids=["no-gaussian-cached", "gaussian-cached"])
@pytest.mark.parametrize("library", ["numpy", "random", "random-by-getstate"])
def test_one_gaussian_is_seen_whether_or_not_the_reader_left_one_cached(
    cached, library, monkeypatch
):
    """The states of numpy and random are read cheaply through their twisters' bytes (random's
    through CPython's layout, and by `getstate` where that is not found): the reader's cached
    Gaussian (an odd count of its own Gaussian draws) must not hide an item's draw of it, nor be
    lost; and a state kept from a read before the reader drew again must not be restored."""
    if library == "random-by-getstate":
        monkeypatch.setattr(seeding._RANDOM, "_address", None)
    elif library == "random":  # CPython's layout is found where the tests run
        assert seeding._RANDOM._address is not None
    library = library.split("-")[0]
    key = seeding.training_key(0, 1)
    want = defined(OneGaussian(library), key)
    assert want[5][1] != 0
    seeding.seed(3)
    read(Nothing(), key, batch=4)  # the reader's state is known, then moves
    next_draws()
    if cached:
        np.random.standard_normal(), random.gauss()
    state = generator_states()
    assert (state[2][3] == 1, state[1][2] is not None) == (cached, cached)
    assert_same(read(OneGaussian(library), key, batch=4), want)
    after = generator_states()
    assert after[1] == state[1]
    assert after[2][2:] == state[2][2:] and np.array_equal(after[2][1], state[2][1])


class OneNormal(Draws):
    """Only item 5 draws, and only one double normal from torch: served from the normal torch keeps
    from its last pair where the reader left one cached, a draw that moves no twister."""

    def __getitem__(self, i: int) -> dict:
        more = torch.randn((), dtype=torch.float64).item() if i == 5 else 0.0
        return {"i": i, "drawn": torch.tensor([0.0, more, 0.0], dtype=torch.float64)}


@pytest.mark.parametrize("cached", [False, True], ids=["no-normal-cached", "normal-cached"])
@pytest.mark.parametrize("look", ["mark", "whole"])
def test_a_draw_from_torch_is_seen_by_its_mark_or_its_whole_state(cached, look, monkeypatch):
    """torch's state is kept with a mark read in its generator's object (its twister's position
    and ends, its cached normals), where that layout is found, and else read whole: either way an
    item's one normal is seen, a cached one served without moving the twister too, and the
    reader's state is restored with its cache."""
    reader = seeding._TORCH_READER
    if look == "whole":
        monkeypatch.setattr(reader, "_words", None)
        monkeypatch.setattr(reader, "_known", None)
    else:  # the layout is found where the tests run
        assert reader._words is not None
    key = seeding.training_key(0, 1)
    want = defined(OneNormal(), key)
    assert want[5][1] != 0
    seeding.seed(3)
    read(Nothing(), key, batch=4)  # the reader's state is known, then moves
    next_draws()
    if cached:
        torch.randn((), dtype=torch.float64)  # the other of a pair, kept for the next draw
    before = torch.default_generator.get_state()
    assert_same(read(OneNormal(), key, batch=4), want)
    assert torch.equal(torch.default_generator.get_state(), before)


def test_torchs_layout_is_not_taken_where_it_does_not_match(monkeypatch):
    """Where torch's generator holds its state otherwise (another torch), no offset is taken and
    every state is read whole."""
    assert seeding._torch_words(torch.default_generator) is not None
    monkeypatch.setattr(seeding, "_TORCH_OBJECT", seeding.struct.Struct("=QiB3xI624If?3x4xd?7x"))
    assert seeding._torch_words(torch.default_generator) is None
    monkeypatch.setattr(seeding, "_TORCH_STATE", seeding.struct.Struct("=QiiQ"))
    assert seeding._torch_words(torch.default_generator) is None


def test_a_restored_state_with_a_cached_gaussian_is_not_taken_for_the_kept_one():
    """phalanx's own restores (and resumes) set NumPy's state: one with a Gaussian cached, over the
    same twister as the state kept without one, must be read whole, or an item's one Gaussian comes
    from the reader's cache unseen."""
    key = seeding.training_key(0, 1)
    want = defined(OneGaussian("numpy"), key)
    np.random.seed(0)
    np.random.standard_normal()  # a Gaussian cached
    saved = seeding.states()
    np.random.standard_normal()  # the cache spent: the same twister, kept without one
    seeding.states()
    seeding.restore(saved)
    assert np.random.get_state()[3] == 1
    assert_same(read(OneGaussian("numpy"), key, batch=N), want)
    assert np.random.get_state()[3] == 1


@pytest.mark.parametrize("kind", [np.random.MT19937, np.random.PCG64])
def test_a_new_global_bit_generator_is_read_as_itself(kind):
    """`np.random.set_bit_generator` gives the global functions another generator: its draws are
    seen, and its state restored (not the first one's, whose memory may be gone), a Mersenne
    Twister's or another kind's, which the legacy state cannot hold."""
    original = np.random.get_bit_generator()
    key = seeding.training_key(0, 1)
    try:
        read(Nothing(), key)  # the first generator's twister kept
        np.random.set_bit_generator(kind(7))
        want = defined(Draws(), key)
        state = np.random.get_state(legacy=False)
        drawn = np.random.random()
        np.random.set_state(state)
        assert_same(read(Draws(), key), want)
        assert np.random.random() == drawn
    finally:
        np.random.set_bit_generator(original)
