"""Sample order, sharding and batching that do not depend on the number of devices (contract 2,
3)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import toy
from torch.utils.data import default_collate

from phalanx import batching, data, loading
from phalanx.errors import DataError
from phalanx.feed import Ahead

pytestmark = pytest.mark.timeout(60)


# --- permutation -------------------------------------------------------------------------------


def test_permutation_is_a_permutation():
    for n in (1, 2, 17, 100):
        perm = data.permutation(3, 1, n)
        assert sorted(perm) == list(range(n))


def test_the_order_is_a_bijection_for_every_size_and_seed():
    """Every n up to 600 and a spread of sizes up to 10^5 (odd and even bit widths, powers of two
    and their neighbours), for several seeds and epochs: every index exactly once."""
    sizes = [*range(0, 601), 1023, 1024, 1025, 4095, 4097, 65535, 65536, 65537, 99_991, 100_000]
    for n in sizes:
        for seed, epoch in ((0, 1), (1, 2), (12345, 7)):
            values = sorted(data.Order(seed, epoch, n))
            assert values == list(range(n)), (n, seed, epoch)


def test_the_order_looks_random():
    """No trace of the positions in the indices, and every first index about equally likely."""
    order = torch.tensor(data.permutation(0, 1, 100_000), dtype=torch.float64)
    positions = torch.arange(100_000, dtype=torch.float64)
    assert abs(float(torch.corrcoef(torch.stack([order, positions]))[0, 1])) < 0.02
    firsts = torch.bincount(
        torch.tensor([data.Order(seed, 1, 10)[0] for seed in range(5000)]), minlength=10
    )
    assert int(firsts.min()) > 400 and int(firsts.max()) < 600  # 500 expected for each


def test_an_epoch_of_ten_billion_samples_costs_no_memory_and_starts_at_once():
    import tracemalloc

    tracemalloc.start()
    order = data.Order(0, 1, 10**10)
    plan = data.Plan(order, 1024, accumulation=2, rank=1, world_size=3)
    micros = plan.step(0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(plan) == -(-(10**10) // 1024) and plan.micro_batches() == 2 * len(plan)
    assert sum(len(m.shard) for m in micros) == 1024 // 3 + 1
    assert all(0 <= i < 10**10 for m in micros for i in m.shard)
    # one block of positions; a list of every index would be 80 GB (and take minutes to build)
    assert peak < 16 * 2**20, peak


def test_the_order_does_not_depend_on_the_world_size():
    order = data.Order(3, 2, 97)
    for world_size in (1, 2, 3, 5):
        for accumulation in (1, 3):
            taken = []
            plans = [
                data.Plan(order, 10, accumulation, rank, world_size) for rank in range(world_size)
            ]
            for k in range(len(plans[0])):
                steps = [plan.step(k) for plan in plans]
                for micro in range(len(steps[0])):
                    taken += [i for rank_steps in steps for i in rank_steps[micro].shard]
            assert taken == list(order)


def test_the_order_is_the_one_runs_began_with():
    """A checkpoint holds a cursor into its epoch's order: the order must not change from one
    version to the next, or a resumed epoch would take other samples. The first indices of a few
    orders, as phalanx computed them when the order was introduced: a table walked (n up to
    2**18), the rounds computed per position, and 32-bit halves and wider."""
    assert data.Order(0, 1, 12800)[0:6] == [11297, 6211, 1188, 4894, 5690, 11622]
    assert data.Order(2, 2, 97)[0:6] == [49, 46, 40, 5, 31, 9]
    assert data.Order(1, 0, 300_000)[0:6] == [172856, 175361, 68924, 224938, 14687, 81462]
    assert data.Order(0, 1, 10**6)[0:3] == [944952, 429799, 37809]
    assert data.Order(0, 1, 10**10)[0:3] == [3706550633, 8991815418, 9864624772]


def test_runs_started_before_the_feistel_order_keep_theirs():
    """randperm: the order of checkpoints that name none, still a function of the seed and epoch."""
    old = data.epoch_order(7, 2, 50, data.RANDPERM)
    assert old == data.epoch_order(7, 2, 50, data.RANDPERM) and sorted(old) == list(range(50))
    assert old != list(data.epoch_order(7, 2, 50))


def test_permutation_depends_only_on_seed_and_epoch():
    reference = data.permutation(7, 2, 50)
    torch.manual_seed(12345)  # the global RNG must not matter
    torch.rand(100)
    assert data.permutation(7, 2, 50) == reference
    torch.manual_seed(0)
    assert data.permutation(7, 2, 50) == reference
    assert data.permutation(7, 3, 50) != reference  # another epoch, another order
    assert data.permutation(8, 2, 50) != reference  # another seed, another order
    epochs = [tuple(data.permutation(7, e, 50)) for e in range(1, 6)]
    assert len(set(epochs)) == len(epochs)


# --- split_sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 10, 23])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_split_sizes_even(n, parts):
    sizes = data.split_sizes(n, parts)
    assert len(sizes) == parts
    assert sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra samples go to the first ranks


@pytest.mark.parametrize(
    "n, weights",
    [
        (10, [1, 1, 2]),
        (100, [3, 1]),
        (7, [0.5, 0.25, 0.25]),
        (13, [2, 1, 1, 1]),
        (5, [1, 1, 1, 1, 1, 1]),
    ],
)
def test_split_sizes_follow_weights(n, weights):
    sizes = data.split_sizes(n, len(weights), weights)
    assert sum(sizes) == n
    total = sum(weights)
    for size, w in zip(sizes, weights, strict=True):
        assert abs(size - n * w / total) < 1
    assert all(s >= 0 for s in sizes)


def test_split_sizes_weights_scale_freely():
    assert data.split_sizes(12, 3, [1, 2, 3]) == data.split_sizes(12, 3, [10, 20, 30])
    assert data.split_sizes(12, 3, [1, 1, 1]) == [4, 4, 4]
    assert data.split_sizes(12, 2, [3, 1]) == [9, 3]


def test_split_is_contiguous_and_in_order():
    pieces = data.split(list(range(10, 20)), 3)
    assert pieces == [[10, 11, 12, 13], [14, 15, 16], [17, 18, 19]]


# --- Plan --------------------------------------------------------------------------------------


def _plans(order, batch_size, accumulation, world_size):
    return [
        data.Plan(order, batch_size, accumulation, rank, world_size) for rank in range(world_size)
    ]


@pytest.mark.parametrize(
    "n", [41, 22]
)  # last batch of 41 with B=8 or 10, and of 22 with B=7: one sample
@pytest.mark.parametrize("batch_size", [7, 8, 10])
@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_plan_covers_every_sample_once_and_reassembles_the_global_batch(
    n, batch_size, accumulation, world_size
):
    order = data.permutation(5, 1, n)
    plans = _plans(order, batch_size, accumulation, world_size)
    assert all(len(p) == -(-n // batch_size) for p in plans)
    seen = []
    for k in range(len(plans[0])):
        expected = order[k * batch_size : (k + 1) * batch_size]
        per_rank = [p.step(k) for p in plans]
        n_micro = len(per_rank[0])
        assert all(len(m) == n_micro for m in per_rank)  # every rank runs every micro-batch
        assert n_micro == min(accumulation, len(expected))
        step_samples = []
        for j in range(n_micro):
            shards = [per_rank[r][j].shard for r in range(world_size)]
            assert all(per_rank[r][j].global_size == len(expected) for r in range(world_size))
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1
            step_samples += list(itertools.chain(*shards))  # rank order
        assert step_samples == expected  # shards are contiguous, in rank order
        seen += step_samples
    assert sorted(seen) == list(range(n))
    assert seen == order


def test_plan_last_batch_smaller_than_world_size_leaves_empty_shards():
    order = list(range(9))  # batch 8: the last step has one sample
    plans = _plans(order, 8, 1, 4)
    last = [p.step(1) for p in plans]
    assert [m[0].shard for m in last] == [[8], [], [], []]
    assert all(m[0].global_size == 1 for m in last)


def test_plan_micro_batches_split_the_global_batch_contiguously():
    order = list(range(100, 110))
    micros = data.Plan(order, 10, 3).step(0)
    assert [m.shard for m in micros] == [[100, 101, 102, 103], [104, 105, 106], [107, 108, 109]]
    assert all(m.global_size == 10 for m in micros)


def test_plan_with_weights_follows_them():
    order = list(range(12))
    shards = [data.Plan(order, 12, 1, r, 3, weights=[1, 2, 3]).step(0)[0].shard for r in range(3)]
    assert shards == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]


def test_plan_steps_from_a_start():
    plan = data.Plan(list(range(23)), 5)
    assert [k for k, _ in plan.steps(2)] == [2, 3, 4]
    assert [m.shard for _, micros in plan.steps(4) for m in micros] == [[20, 21, 22]]
    assert list(plan.steps(5)) == []


# --- loader ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, accumulation", [(1, 1), (3, 1), (2, 3)])
@pytest.mark.parametrize("start", [0, 2, 5])
def test_loader_from_a_start_yields_exactly_the_remaining_shards(world_size, accumulation, start):
    stream = toy.Regression(n_train=41).streams()["train"]
    order = data.permutation(1, 1, len(stream))
    for rank in range(world_size):
        plan = data.Plan(order, 8, accumulation, rank, world_size)
        expected = [m.shard for _, micros in plan.steps(start) for m in micros]
        got = []
        for batch in loading.loader(stream, plan, start):
            got.append([] if batch is None else batch["id"].tolist())
        assert got == expected
        for batch, shard in zip(loading.loader(stream, plan, start), expected, strict=True):
            if shard:
                assert torch.equal(batch["x"], stream.x[shard])
                assert torch.equal(batch["y"], stream.y[shard])
    if start == 0 and world_size == 1:
        assert [i for shard in expected for i in shard] == order


def test_collate_stacks_dict_items_and_empty_is_none():
    items = [{"x": torch.tensor([1.0, 2.0]), "y": 3}, {"x": torch.tensor([4.0, 5.0]), "y": 6}]
    batch = batching.collate(items)
    assert torch.equal(batch["x"], torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    assert batch["y"].tolist() == [3, 6]
    assert batching.collate([]) is None


def _collated_by(monkeypatch) -> list[int]:
    """The number of items of each batch that torch's default_collate makes from here on."""
    calls: list[int] = []

    def counted(items):
        calls.append(len(items))
        return default_collate(items)

    monkeypatch.setattr(batching, "default_collate", counted)
    return calls


@pytest.mark.parametrize("named", [False, True], ids=["dicts", "tuples-named-by-keys"])
def test_common_items_are_batched_as_default_collate_batches_them_without_it(monkeypatch, named):
    """The common items, plain dicts (or tuples named by dataset.keys) of dense tensors, ints and
    floats, are batched part by part directly (no Python a sample); the batch is default_collate's
    to the key order, dtype and value."""
    items = [
        {
            "image": torch.randn(3, 4, 4),
            "label": i,
            "mask": torch.rand(5) > 0.5,
            "weight": 0.5 * i,
            "target": torch.tensor(0.5 * i, dtype=torch.float64),
        }
        for i in range(6)
    ]
    want = default_collate(items)
    keys = tuple(items[0])
    if named:
        items = [tuple(item.values()) for item in items]
    calls = _collated_by(monkeypatch)
    got = batching.collate(items, keys=keys if named else None)
    assert calls == []  # batched here, not by default_collate
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize(
    "items",
    [
        [{"x": torch.zeros(2), "y": i % 2 == 0} for i in range(3)],  # bools: a bool tensor
        [{"x": torch.zeros(2), "id": f"item{i}"} for i in range(3)],  # strings: a list
        [{"x": torch.nn.Parameter(torch.zeros(2))} for _ in range(3)],  # a tensor subclass
        [OrderedDict(x=torch.zeros(2)) for _ in range(3)],  # a mapping of another type, kept
    ],
    ids=["bools", "strings", "tensor-subclass", "ordered-dict"],
)
def test_other_batches_are_default_collates(monkeypatch, items):
    want = default_collate(items)
    calls = _collated_by(monkeypatch)
    got = batching.collate(items)
    assert calls == [3]
    assert type(got) is type(want) and list(got) == list(want)
    for key, value in want.items():
        assert got[key] == value if isinstance(value, list) else torch.equal(got[key], value)


def test_items_that_do_not_batch_are_said_as_before():
    ragged = [{"x": torch.zeros(3)}, {"x": torch.zeros(4)}]
    with pytest.raises(DataError, match=r"stream 'test', key 'x': items of different shapes"):
        batching.collate(ragged, "test")
    missing = [{"x": torch.zeros(2), "y": 1}, {"x": torch.zeros(2)}]
    with pytest.raises(DataError, match=r"items hold different keys \(\['x', 'y'\] and \['x'\]\)"):
        batching.collate(missing, "test")
    uneven = [(torch.zeros(2), 1), (torch.zeros(2), 1, 2)]
    with pytest.raises(DataError, match=r"an item has 3 parts but dataset.keys names 2"):
        batching.collate(uneven, "test", keys=("x", "y"))


def test_a_worker_process_leaves_its_batches_to_default_collate(monkeypatch):
    """In a DataLoader worker, default_collate puts the batch in shared memory for the trip to
    the training process; the batch is its own there."""
    monkeypatch.setattr(batching, "get_worker_info", lambda: object())
    calls = _collated_by(monkeypatch)
    batching.collate([{"x": torch.zeros(2)}, {"x": torch.ones(2)}])
    assert calls == [2]


@pytest.mark.parametrize("item", [(torch.zeros(2), 1), torch.zeros(2), 5])
def test_collate_rejects_non_dict_items(item):
    with pytest.raises(DataError, match="must be dicts"):
        batching.collate([item, item])


class Ragged(torch.utils.data.Dataset):
    """Items whose `x` has 3 values, except item 2's, which has 4."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.zeros(4 if i == 2 else 3), "y": i}


def _one_line_error(stream, name: str, num_workers: int = 0) -> str:
    plan = data.Plan(range(len(stream)), 4)
    with pytest.raises(DataError) as info:
        list(loading.loader(stream, plan, num_workers=num_workers, name=name))
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def test_items_of_different_shapes_name_the_stream_the_key_and_the_shapes():
    message = _one_line_error(Ragged(), "valid")
    assert (
        "stream 'valid', key 'x'" in message
        and "[3] and [4]" in message
        and "pad or crop" in message
    )


def test_a_collate_error_in_a_worker_process_is_the_same_one_line():
    """DataLoader re-raises a worker's exception with the worker's traceback inside its message."""
    message = _one_line_error(Ragged(), "train", num_workers=1)
    assert "stream 'train', key 'x'" in message and "[3] and [4]" in message


def test_items_with_different_keys_or_types_are_named():
    items = [{"x": torch.zeros(2), "y": 1}, {"x": torch.zeros(2)}]
    with pytest.raises(
        DataError, match=r"stream 'test': items hold different keys \(\['x', 'y'\] and \['x'\]\)"
    ):
        batching.collate(items, "test")
    items = [{"x": torch.zeros(2), "y": 1}, {"x": torch.zeros(2), "y": "one"}]
    with pytest.raises(
        DataError,
        match=r"stream 'test', key 'y': items hold values of different types \(int, str\)",
    ):
        batching.collate(items, "test")


def test_batch_size_of():
    assert batching.batch_size_of({"id": [1, 2], "x": torch.zeros(5, 3)}) == 5
    with pytest.raises(DataError, match="no tensor"):
        batching.batch_size_of({"name": ["a", "b"], "scalar": torch.tensor(1.0)})


# --- get_stream --------------------------------------------------------------------------------


def test_get_stream_returns_the_named_stream():
    dataset = toy.Regression()
    assert data.get_stream(dataset, "valid") is dataset.streams()["valid"]


def test_get_stream_missing_stream_lists_the_available_ones():
    with pytest.raises(DataError) as info:
        data.get_stream(toy.Regression(), "tset")
    message = str(info.value)
    assert "'tset'" in message
    for name in ("train", "valid", "test"):
        assert name in message


def test_get_stream_of_streams_that_are_not_by_name():
    class Listed:
        def streams(self):
            return [[1, 2], [3]]

    with pytest.raises(DataError, match=r"Listed.streams\(\) returned a list; return the streams"):
        data.get_stream(Listed(), "train")


def test_get_stream_of_streams_that_fail_to_open_says_so_in_one_line():
    class Missing:
        def streams(self):
            raise FileNotFoundError("data/train.bin: no such file\n  (searched in /data)")

    with pytest.raises(DataError) as info:
        data.get_stream(Missing(), "train")
    said = str(info.value)
    assert said.startswith("dataset: Missing.streams() failed: FileNotFoundError: data/train.bin")
    assert "\n" not in said and said.endswith("(the files, paths or splits it reads)")


def test_a_constructor_failure_is_quoted_in_one_line():
    from phalanx.construct import instantiate
    from phalanx.errors import ConfigError

    def native(size):
        raise RuntimeError(f"size {size} overflows\nframe #0: c10::Error\nframe #1: at::empty")

    with pytest.raises(ConfigError) as info:
        instantiate("dataset", native, size=10**30)
    assert "failed: RuntimeError: size " in str(info.value) and "frame" not in str(info.value)


@pytest.mark.parametrize(
    "length, said",
    [
        (-1, "ValueError: __len__() should return >= 0"),
        ("10", "TypeError: 'str' object cannot be interpreted as an integer"),
        (OSError("index file gone"), "OSError: index file gone"),
    ],
)
def test_a_stream_whose_length_is_not_a_count_is_refused_in_one_line(length, said):
    class Items(torch.utils.data.Dataset):
        def __len__(self):
            if isinstance(length, Exception):
                raise length
            return length

        def __getitem__(self, i):
            return {"x": torch.zeros(1)}

    class Streams:
        def streams(self):
            return {"train": Items()}

    with pytest.raises(DataError) as info:
        data.get_stream(Streams(), "train")
    assert str(info.value) == (
        f"stream 'train' of Streams: len() failed: {said}; its __len__ must return the number of "
        "samples it holds, an int of 0 or more"
    )


@pytest.mark.parametrize(
    "raised, said",
    [
        (FileNotFoundError(2, "No such file or directory"), "FileNotFoundError: [Errno 2] No such"),
        (KeyError("split"), "KeyError: 'split'"),
    ],
)
def test_a_constructor_that_cannot_find_its_files_or_keys_is_quoted_in_one_line(raised, said):
    from phalanx.construct import instantiate
    from phalanx.errors import ConfigError

    def opens(path):
        raise raised

    with pytest.raises(ConfigError) as info:
        instantiate("dataset", opens, path="data/train.bin")
    said_all = str(info.value)
    assert said_all.startswith("dataset: ") and f".opens(path='data/train.bin') failed: {said}" in (
        said_all
    )
    assert said_all.endswith("; fix the values in the dataset section")


def test_a_constructor_that_imports_a_missing_package_says_to_install_it():
    from phalanx.construct import instantiate
    from phalanx.errors import ConfigError

    def imports():
        import phalanx_no_such_package  # noqa: F401

    with pytest.raises(ConfigError) as info:
        instantiate("model", imports)
    assert str(info.value).startswith("model: ") and str(info.value).endswith(
        ".imports failed: ModuleNotFoundError: No module named 'phalanx_no_such_package'; "
        "install what it imports"
    )


def test_a_constructor_out_of_memory_is_not_said_as_bad_input():
    from phalanx.construct import instantiate

    def allocates():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        instantiate("model", allocates)


def test_get_stream_without_streams_method():
    class NoStreams:
        pass

    with pytest.raises(DataError, match="no streams\\(\\) method"):
        data.get_stream(NoStreams(), "train")

    class NotCallable:
        streams = {"train": []}

    with pytest.raises(DataError, match="no streams\\(\\) method"):
        data.get_stream(NotCallable(), "train")


def test_get_stream_rejects_an_empty_stream():
    """An empty train stream trained zero steps and exited 0."""
    with pytest.raises(DataError, match="stream 'train' of Regression is empty"):
        data.get_stream(toy.Regression(n_train=0), "train")


def test_get_stream_rejects_non_map_style_streams():
    class Iterable:
        def streams(self):
            return {"train": iter(range(3))}

    with pytest.raises(DataError, match="an iterator .* can be read only once"):
        data.get_stream(Iterable(), "train")

    class Neither:
        def streams(self):
            return {"train": 3}

    with pytest.raises(DataError, match="map-style dataset .* or an iterable one"):
        data.get_stream(Neither(), "train")


# --- items that are not dicts ------------------------------------------------------------------


def test_tuple_list_and_tensor_items_are_named_by_dataset_keys():
    x, y = torch.randn(5, 3), torch.randn(5)
    pairs = torch.utils.data.TensorDataset(x, y)
    named = batching.named(pairs, ["x", "y"], "train")
    assert len(named) == 5 and torch.equal(named[2]["x"], x[2]) and torch.equal(named[2]["y"], y[2])
    assert torch.equal(batching.named([x[0], x[1]], ["image"], "train")[1]["image"], x[1])
    assert batching.named(pairs, None, "train") is pairs
    with pytest.raises(DataError, match="an item has 2 parts but dataset.keys names 3"):
        batching.named(pairs, ["x", "y", "z"], "train")[0]
    with pytest.raises(DataError, match="name their parts with dataset.keys"):
        batching.collate([pairs[0], pairs[1]])
    stream = batching.named(
        toy.StreamItems(toy.Regression().streams()["valid"]), ["ignored"], "valid"
    )
    assert data.is_iterable(stream) and data.stream_length(stream) is None
    assert callable(stream.set_epoch) and next(iter(stream))["x"].shape == (
        3,
    )  # dicts pass through


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_names_whole_batches_not_each_item(workers):
    """The DataLoader reads the tuples themselves and names each batch: naming every item in
    Python cost a tenth of a small model's step."""
    x, y = torch.randn(10, 3), torch.arange(10)
    pairs = torch.utils.data.TensorDataset(x, y)
    order = [3, 1, 4, 0, 5, 9, 2, 6, 8, 7]
    made = loading.loader(
        batching.named(pairs, ["x", "y"], "train"), data.Plan(order, 4), num_workers=workers
    )
    assert made.dataset is pairs
    batches = list(made)
    assert [list(b) for b in batches] == [["x", "y"]] * 3
    assert torch.equal(torch.cat([b["y"] for b in batches]), torch.tensor(order))
    assert torch.equal(torch.cat([b["x"] for b in batches]), x[order])
    lone = loading.loader(batching.named(list(x), ["image"], "train"), data.Plan(order, 4))
    assert torch.equal(next(iter(lone))["image"], x[order[:4]])
    wrong = loading.loader(
        batching.named(pairs, ["x", "y", "z"], "train"),
        data.Plan(order, 4),
        num_workers=workers,
        name="train",
    )
    with pytest.raises(
        DataError, match="stream 'train': an item has 2 parts but dataset.keys names 3"
    ):
        next(iter(wrong))


@pytest.mark.parametrize("dataset", ["toy.TupleRegression", "toy.ListRegression"])
def test_a_tensor_dataset_trains_as_its_dict_twin(dataset):
    """The same samples as tuples (TensorDataset) or lists, named x and y, train to the very same
    parameters as toy.Regression's dict items."""
    from phalanx import config
    from phalanx.trainer import Trainer

    def trained(cls: str, keys: list[str] | None) -> dict:
        raw = toy.regression_config(
            dataset={"class": cls, "batch_size": 8, **({"keys": keys} if keys else {})},
            model={"class": "toy.Linear", "features": 3},
            hooks=[],
        )
        trainer = Trainer(config.validate(raw), None, [Path(toy.__file__).parent])
        assert trainer.run() == 0
        return trainer.model.state_dict()

    want, got = trained("toy.Regression", None), trained(dataset, ["x", "y"])
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("n", [1, 2, 3, 1280, 4096, 4097, 70_000])
def test_a_small_epochs_order_looked_up_is_the_order_walked(n, monkeypatch):
    """Domains up to data._TABLE run the rounds once over the whole domain and walk by lookups: the
    same order as running the rounds at every step of the walk."""
    looked_up = list(data.Order(5, 2, n))
    monkeypatch.setattr(data, "_TABLE", 0)
    walked = list(data.Order(5, 2, n))
    assert looked_up == walked and sorted(walked) == list(range(n))


# --- reading a step ahead -------------------------------------------------------------------------


def test_a_step_read_ahead_comes_in_its_turn():
    read: list[int] = []

    def steps():
        for k in range(3):
            read.append(k)
            yield k, []

    ahead = Ahead(steps())
    assert next(ahead) == (0, []) and read == [0]
    ahead.fetch()
    assert read == [0, 1] and ahead.seconds > 0
    ahead.fetch()  # once a step: the step read ahead is not read past
    assert read == [0, 1]
    assert next(ahead) == (1, []) and read == [0, 1]
    assert next(ahead) == (2, [])
    ahead.fetch()  # none after the last
    assert list(ahead) == [] and read == [0, 1, 2]


def test_a_read_ahead_that_fails_fails_in_its_turn():
    """The error of a step read ahead comes where the step would have been read, after the step
    before it; an interruption is not held back."""

    def steps():
        yield 0, []
        raise DataError("item 7 of stream 'train' could not be read")

    ahead = Ahead(steps())
    assert next(ahead) == (0, [])
    ahead.fetch()  # the step before goes on
    with pytest.raises(DataError, match="item 7"):
        next(ahead)

    def interrupted():
        yield 0, []
        raise KeyboardInterrupt

    ahead = Ahead(interrupted())
    next(ahead)
    with pytest.raises(KeyboardInterrupt):
        ahead.fetch()
