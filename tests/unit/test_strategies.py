"""Choosing a strategy, and the start-up checks that do not need several processes."""

from __future__ import annotations

import copy

import pytest
import torch
import toy

from phalanx import config, strategies
from phalanx.errors import ConfigError
from phalanx.strategies import progress
from phalanx.strategies.base import Strategy
from phalanx.strategies.ddp import DDP
from phalanx.strategies.distributed import _flatten, check_same_config
from phalanx.strategies.single import Single

pytestmark = pytest.mark.timeout(60)


def cfg(**parallel):
    return config.validate(toy.regression_config(parallel=parallel))


def test_one_device_is_the_single_strategy(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert isinstance(strategies.create(cfg()), Single)
    assert not strategies.needs_launch(cfg())


def test_several_cpu_devices_are_launched_as_processes(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert strategies.needs_launch(cfg(accelerator="cpu", devices=3))
    assert strategies.resolve_device(cfg(accelerator="cpu", devices=3)) == ("cpu", 3)


def test_inside_a_worker_nothing_is_relaunched(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not strategies.needs_launch(cfg(accelerator="cpu", devices=2))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without GPUs"
)
def test_asking_for_gpus_without_any_names_the_fix():
    with pytest.raises(ConfigError, match="n_gpus=2 asks for CUDA GPUs but none is visible"):
        strategies.resolve_device(config.validate(toy.regression_config(model={"n_gpus": 2})))


def test_param_servers_need_no_gpu(monkeypatch):
    """Two GPUs: two workers and a server in host memory fit, a third worker does not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    served = {"accelerator": "cuda", "strategy": "param_server", "param_server": {"servers": 1}}
    assert strategies.resolve_device(cfg(devices=3, **served)) == ("cuda", 3)
    with pytest.raises(ConfigError, match=r"asks for 3 GPU workers, but 2 GPU\(s\) are visible"):
        strategies.resolve_device(cfg(devices=4, **served))
    with pytest.raises(ConfigError, match="3 GPUs requested but 2 are visible"):
        strategies.resolve_device(cfg(accelerator="cuda", devices=3))


def test_a_pipeline_in_one_process_or_over_gloo_on_gpus_is_one_error(monkeypatch):
    """torch's schedules need two processes or more; gloo would read GPU memory as the host's."""
    one = {"split": ["net.2"], "schedule": "interleaved"}  # two stages, two a process
    with pytest.raises(ConfigError, match="puts its 2 stages in one process.*split it at 3 points"):
        strategies.create(cfg(strategy="pipeline", accelerator="cpu", pipeline=one))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    two = {"split": ["net.2"]}
    gloo = cfg(strategy="pipeline", accelerator="cuda", devices=2, backend="gloo", pipeline=two)
    with pytest.raises(ConfigError, match="gloo cannot send GPU memory"):
        strategies.create(gloo)


@pytest.mark.parametrize(
    ("pipeline", "processes", "message"),
    [
        ({"split": ["net.2"], "microbatches": 1}, 2, r"1f1b needs at least as many micro-batches"),
        ({"split": ["net.2", "net.4"], "microbatches": 2}, 3, r"2 micro-batches for 3 stages"),
        (
            {"split": ["net.1", "net.2", "net.3"], "microbatches": 3, "schedule": "dualpipev"},
            2,
            r"dualpipev needs .* 3 micro-batches for 4 stages",
        ),
        (
            {"split": ["net.1", "net.2", "net.3"], "microbatches": 5, "schedule": "interleaved"},
            2,
            r"5 micro-batches do not share out evenly over 2 rounds .* a multiple of 2",
        ),
        ({"split": ["net.2"], "microbatches": 4}, 3, r"set parallel.devices to a multiple of 2"),
    ],
    ids=["1f1b-one", "1f1b-three-stages", "dualpipev", "interleaved-rounds", "devices"],
)
def test_a_pipeline_that_cannot_run_its_micro_batches_is_refused_before_it_starts(
    pipeline, processes, message
):
    """The conditions torch's schedules set as they are built (at the first step), checked on the
    config alone: `phalanx train` and `resume` refuse it before any process starts."""
    piped = cfg(strategy="pipeline", accelerator="cpu", devices=processes, pipeline=pipeline)
    with pytest.raises(ConfigError, match=message):
        strategies.check(piped, processes)


def test_pipelines_whose_schedules_can_run_pass_the_check():
    for pipeline, processes in [
        ({"split": ["net.2"], "microbatches": 1, "schedule": "gpipe"}, 2),
        ({"split": ["net.2", "net.4"], "microbatches": 3}, 3),
        ({"split": ["net.1", "net.2", "net.3"], "microbatches": 1, "schedule": "interleaved"}, 2),
        ({"split": ["net.1", "net.2", "net.3"], "microbatches": 4, "schedule": "dualpipev"}, 2),
        ({"split": ["net.2"], "microbatches": 2}, 4),  # two copies of two stages
    ]:
        piped = cfg(strategy="pipeline", accelerator="cpu", devices=processes, pipeline=pipeline)
        strategies.check(piped, processes)


def test_param_server_says_that_dataloader_workers_serve_evaluation_alone(caplog):
    """Its workers read the training samples they take themselves: a DataLoader's workers would
    only start for the evaluated streams, and the user who asked for them is told."""
    served = {"accelerator": "cpu", "devices": 3, "strategy": "param_server"}
    for readers, said in ((2, True), (0, False), ("auto", False)):
        caplog.clear()
        dataset = {"class": "toy.Regression", "batch_size": 8, "num_workers": readers}
        strategies.check(
            config.validate(toy.regression_config(parallel=served, dataset=dataset)), 3
        )
        warned = "dataset.num_workers=2 serves the evaluated streams only" in caplog.text
        assert warned == said, caplog.text


def test_param_server_workers_but_the_main_one_rejoin_where_restarts_are_allowed():
    served = {"strategy": "param_server", "param_server": {"servers": 1}}
    assert strategies.rejoining(cfg(devices=4, max_restarts=2, **served), 4) == (1, 2)
    assert strategies.rejoining(cfg(devices=4, **served), 4) == ()  # no restarts
    assert strategies.rejoining(cfg(devices=2, max_restarts=2), 2) == ()  # ddp restarts them all


def test_nccl_on_the_cpu_names_the_fix():
    with pytest.raises(
        ConfigError,
        match="parallel.backend=nccl joins CUDA GPUs.*set parallel.backend=auto or gloo",
    ):
        strategies.resolve_device(cfg(accelerator="cpu", devices=2, backend="nccl"))
    assert strategies.resolve_device(cfg(accelerator="cpu", devices=2, backend="gloo")) == (
        "cpu",
        2,
    )


def test_single_strategy_with_several_devices_is_refused(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="strategy=single"):
        strategies.create(cfg(accelerator="cpu", devices=2, strategy="single"))


def test_unknown_strategy_lists_the_choices(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="auto, plan, single, ddp"):
        strategies.create(cfg(strategy="pipelines"))
    with pytest.raises(ConfigError, match='"ddp"'):
        strategies.create(cfg(strategy="dpp"))


def test_a_strategy_section_refuses_unknown_keys_with_a_suggestion():
    with pytest.raises(
        ConfigError, match=r"parallel\.ddp\.bucket_cap_m.*did you mean \"bucket_cap_mb\""
    ):
        cfg(ddp={"bucket_cap_m": 4})
    assert cfg(ddp={"bucket_cap_mb": 4}).parallel.ddp.bucket_cap_mb == 4


def test_every_registered_strategy_has_the_protocol_and_its_summary():
    from phalanx.strategies import registry

    for name, family in registry.families().items():
        assert family.name == name and family.summary and callable(family.build), name
    members = [m for m in vars(Strategy) if not m.startswith("_")]
    single = Single(torch.device("cpu"))
    assert [m for m in members if not hasattr(single, m)] == []
    assert [
        m
        for m in members
        if not hasattr(DDP, m)
        and m not in ("rank", "world_size", "data_rank", "data_world_size", "devices", "device")
    ] == []


class _Ranks:
    """Rank 0 and the other ranks' gathered values, as a process group's gather returns them."""

    def __init__(self, *others: dict):
        self.others = others

    def gather(self, value):
        return [value, *self.others]


def _as_rank(config: dict, torch: str = "x") -> dict:
    return _flatten({"config": config, "versions": {"torch": torch}})


def test_ranks_with_different_configs_are_a_config_error_naming_the_keys_and_values():
    mine = {"optimizer": {"lr": 0.1}, "seed": 0}
    other = _as_rank({"optimizer": {"lr": 0.2}, "seed": 0})
    with pytest.raises(ConfigError, match=r"optimizer\.lr: 0\.1 on rank 0, 0\.2 on rank 1\."):
        check_same_config(_Ranks(other), mine, {"torch": "x"})
    check_same_config(_Ranks(_as_rank(mine)), mine, {"torch": "x"})  # the same: no error


def test_ranks_with_different_versions_name_each_version_and_its_ranks():
    mine = {"seed": 0}
    old = _as_rank(mine, torch="2.11.0")
    with pytest.raises(ConfigError) as got:
        check_same_config(
            _Ranks(_as_rank(mine, "2.13.0"), old, _as_rank(mine, "2.13.0"), old, old),
            mine,
            {"torch": "2.13.0"},
        )
    assert "versions.torch: '2.13.0' on ranks 0-1, 3, '2.11.0' on ranks 2, 4-5." in str(got.value)
    # a key one rank lacks, and a long value clipped
    with pytest.raises(ConfigError) as got:
        check_same_config(_Ranks(_as_rank({"seed": 0, "name": "n" * 100})), mine, {"torch": "x"})
    assert f"config.name: not set on rank 0, '{'n' * 56}... on rank 1" in str(got.value)


def test_lr_scaling_follows_the_global_batch_not_the_device_count():
    from phalanx.build import scaled_lr

    opt = config.validate(
        toy.regression_config(
            optimizer={
                "class": "SGD",
                "lr": 0.1,
                "lr_scaling": {"rule": "linear", "base_batch_size": 4},
            }
        )
    ).optimizer
    assert scaled_lr(opt, 8)["lr"] == pytest.approx(0.2)
    opt = config.validate(
        toy.regression_config(
            optimizer={
                "class": "SGD",
                "lr": 0.1,
                "lr_scaling": {"rule": "sqrt", "base_batch_size": 2},
            }
        )
    ).optimizer
    assert scaled_lr(opt, 8)["lr"] == pytest.approx(0.2)


def test_shard_weights_must_match_the_process_count():
    from phalanx.feed import _shard_weights

    c = cfg(shard_weights=[1, 2])
    assert _shard_weights(c, 1) is None
    assert _shard_weights(c, 2) == [1, 2]
    with pytest.raises(ConfigError, match="2 weights"):
        _shard_weights(c, 3)


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(n)), raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: n)


def test_more_cpu_processes_than_four_per_core_is_an_error_naming_the_override(monkeypatch):
    _cores(monkeypatch, 2)
    with pytest.raises(
        ConfigError,
        match=r"parallel.devices=1000 would start 1000 CPU processes on 2 core\(s\); "
        r"at most 8 .*parallel.oversubscribe=true",
    ):
        strategies.needs_launch(cfg(accelerator="cpu", devices=1000))
    assert strategies.resolve_device(cfg(accelerator="cpu", devices=8)) == ("cpu", 8)
    with pytest.raises(ConfigError, match="would start 9 CPU processes"):
        strategies.resolve_device(cfg(accelerator="cpu", devices=9))


def test_the_test_suites_four_processes_run_on_one_or_two_cores(monkeypatch):
    for n in (1, 2):
        _cores(monkeypatch, n)
        assert strategies.resolve_device(cfg(accelerator="cpu", devices=4)) == ("cpu", 4)


def test_oversubscribe_lifts_the_cpu_process_limit(monkeypatch):
    _cores(monkeypatch, 2)
    assert strategies.resolve_device(cfg(accelerator="cpu", devices=1000, oversubscribe=True)) == (
        "cpu",
        1000,
    )


class _CountedTanh(torch.nn.Tanh):
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def test_activation_checkpointing_recomputes_the_named_modules_with_the_same_gradients():
    from phalanx.strategies.base import checkpoint_modules

    torch.manual_seed(0)
    plain = torch.nn.Sequential(
        torch.nn.Linear(3, 8), _CountedTanh(), torch.nn.Linear(8, 1)
    ).double()
    recomputed = copy.deepcopy(plain)
    assert checkpoint_modules(recomputed, ("_CountedTanh",)) == 1
    assert list(recomputed.state_dict()) == list(
        plain.state_dict()
    )  # the state's names do not change
    x = torch.randn(5, 3, dtype=torch.float64)
    grads = []
    for model in (plain, recomputed):
        _CountedTanh.calls = 0
        model(x).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
        calls = _CountedTanh.calls
    assert calls == 2  # once forward, once again in backward
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    with torch.no_grad():
        _CountedTanh.calls = 0
        recomputed(x)
        assert _CountedTanh.calls == 1  # nothing to recompute without gradients


def test_activation_checkpointing_of_a_class_the_model_lacks_names_the_classes_it_has(tmp_path):
    from phalanx.trainer import Trainer

    raw = toy.regression_config(
        model={"class": "toy.Linear", "features": 3, "hidden": 4},
        activation_checkpointing=["Block"],
    )
    with pytest.raises(
        ConfigError, match="no module of those classes; it has Linear, Sequential, Tanh"
    ):
        Trainer(config.validate(raw), None, [])


def test_training_with_activation_checkpointing_ends_where_training_without_does():
    from phalanx.trainer import Trainer

    ends = []
    for names in ([], ["Tanh"]):
        raw = toy.regression_config(
            model={"class": "toy.Linear", "features": 3, "hidden": 4},
            activation_checkpointing=names,
            hooks=[],
        )
        trainer = Trainer(config.validate(raw), None, [])
        assert trainer.run() == 0
        ends.append(trainer.model.state_dict())
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


def test_fsdp_on_one_device_is_a_group_of_this_process_alone_and_trains_as_single(
    monkeypatch, tmp_path
):
    """No launcher, no port: the group's store is in memory; float64 results are one device's, with
    offload and the meta-device build, and its checkpoints are shards."""
    from phalanx.checkpoint import SHARDS, Checkpoints
    from phalanx.strategies.fsdp import FSDP
    from phalanx.trainer import Trainer

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    ends = {}
    for strategy in ("single", "fsdp"):
        fsdp = {"fsdp": {"offload": True, "init": "meta"}} if strategy == "fsdp" else {}
        raw = toy.contract_config(7, 3, 37, strategy=strategy, **fsdp)
        (tmp_path / strategy).mkdir()
        trainer = Trainer(
            config.validate({**raw, "hooks": ["SaveLatest"]}), tmp_path / strategy, []
        )
        try:
            assert isinstance(trainer.strategy, FSDP if strategy == "fsdp" else Single)
            assert trainer.run() == 0
            state = trainer.strategy.model_state()
            ends[strategy] = state.state_dict() if isinstance(state, torch.nn.Module) else state
        finally:
            trainer.strategy.shutdown()
    assert not torch.distributed.is_initialized()
    for key, value in ends["single"].items():
        assert torch.allclose(ends["fsdp"][key], value, rtol=1e-10, atol=0), key
    step = Checkpoints(tmp_path / "fsdp" / "checkpoints").latest_valid()
    assert (tmp_path / "fsdp" / "checkpoints" / f"step-{step}" / SHARDS / "__0_0.distcp").is_file()


def test_a_failed_run_of_fsdp_on_one_device_leaves_no_group_in_the_users_process(
    monkeypatch, tmp_path
):
    """fsdp on one device makes a group of the user's process alone; a run that fails, new or
    resumed, takes it down as a successful one does, and the process's next run makes its own."""
    import phalanx
    from phalanx.hooks import Hook

    class FailsAtItsFirstBatch(Hook):
        def after_batch(self, stream, batch):
            raise RuntimeError("a hook that fails")

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    raw = {
        **toy.contract_config(7, 1, 21, strategy="fsdp"),
        "hooks": ["SaveLatest"],
        "output_root": str(tmp_path),
    }
    raw["main_loop"]["epochs"] = 1
    with pytest.raises(RuntimeError, match="a hook that fails"):
        phalanx.fit(raw, hooks=[FailsAtItsFirstBatch()])
    assert not torch.distributed.is_initialized()
    run = phalanx.fit(raw)  # a group of its own, not one left behind
    assert run.code == 0 and not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="a hook that fails"):
        phalanx.resume(run.run_dir, overrides="main_loop.epochs=2", hooks=[FailsAtItsFirstBatch()])
    assert not torch.distributed.is_initialized()
    # refused as the strategy is made, after it made the group
    with pytest.raises(ConfigError, match="parallel.build=device builds the whole model"):
        phalanx.fit(raw, overrides="parallel.build=device")
    assert not torch.distributed.is_initialized()

    # failed as the strategy is made, after it joined the group and before it could come back
    def fails(*args, **kwargs):
        raise OSError("no thread for the progress publisher")

    monkeypatch.setattr(progress, "start", fails)
    with pytest.raises(OSError, match="no thread for the progress publisher"):
        phalanx.fit(raw)
    assert not torch.distributed.is_initialized()


def test_fsdp_on_several_devices_outside_a_launcher_names_the_way_to_start_it(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(
        ConfigError,
        match="strategy=fsdp on 2 devices runs one process per device; start it with phalanx train",
    ):
        strategies.create(cfg(accelerator="cpu", devices=2, strategy="fsdp"))


def test_a_mesh_of_one_process_says_what_a_mesh_needs(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError) as info:
        strategies.create(cfg(accelerator="cpu", devices=1, strategy="mesh"))
    said = str(info.value)
    assert said.startswith("parallel.strategy=mesh lays several processes out on a mesh")
    assert "ddp" not in said


class _RecordsWhereBuilt(torch.nn.Module):
    """toy.Linear's shape; records the device its parameters were made on, and a tensor it draws
    while it is built."""

    def __init__(self, features: int = 3):
        super().__init__()
        self.layer = torch.nn.Linear(features, 1, dtype=torch.float64)
        self.built_on = self.layer.weight.device
        self.drawn_on = torch.rand(1).device

    def forward(self, x, y):
        return {"loss": (self.layer(x).squeeze(-1) - y) ** 2}


def test_a_model_built_on_its_device_is_built_inside_that_device(monkeypatch, tmp_path):
    """parallel.build=device: the model's constructor runs with the strategy's device as torch's
    default, so its parameters and what it draws are made there (the meta device here stands for a
    GPU); a model given as an object, built already, is refused."""
    from phalanx.objects import Objects
    from phalanx.trainer import Trainer

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    built = strategies.create(cfg(build="device"))
    assert built.init_context() == built.device == torch.device("cpu")
    assert not isinstance(strategies.create(cfg()).init_context(), torch.device)  # host: as ever
    elsewhere = Single(torch.device("meta"))
    elsewhere.build_on_device = True
    with elsewhere.init_context():
        model = _RecordsWhereBuilt()
    assert model.built_on == model.drawn_on == torch.device("meta")
    with pytest.raises(ConfigError, match="parallel.build: device builds the model itself"):
        Trainer(
            config.validate(toy.regression_config(parallel={"build": "device"})),
            None,
            [tmp_path],
            objects=Objects.given(_RecordsWhereBuilt(), None, None),
        )


@pytest.mark.parametrize(
    ("parallel", "instead"),
    [
        ({"strategy": "fsdp"}, "parallel.fsdp.init=meta"),
        ({"strategy": "placement", "placement": {"net.0": "cpu"}}, "parallel.build=host"),
    ],
    ids=["fsdp", "placement"],
)
def test_building_on_the_device_under_a_strategy_that_splits_the_model_names_the_way(
    monkeypatch, parallel, instead
):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=f"splits it across devices; use {instead}"):
        strategies.create(cfg(build="device", **parallel))


def test_each_pipeline_schedule_is_torchs_by_its_name_and_the_settings_take_the_table():
    """One table of schedules: its names are the settings' choices, each is torch's class by
    `get_schedule_class`'s name, and the stages a process holds by default are what torch's
    schedule runs (several: a schedule that takes a list of stages)."""
    from torch.distributed.pipelining import schedules as torchs

    from phalanx.strategies import schedules
    from phalanx.strategies.staging import PipelineSettings

    for name, schedule in schedules.SCHEDULES.items():
        kind = schedules.torch_class(name)
        assert kind is torchs.get_schedule_class(schedule.torch_name), name
        assert schedules.takes_stages(name) == (schedule.per_process > 1), name
        settings = PipelineSettings(split=["net.2", "net.4", "net.6"], schedule=name)
        assert settings.stages_per_process == schedule.per_process, name
    with pytest.raises(ValueError, match="'gpipe', '1f1b', 'interleaved', 'zero_bubble', 'zbv'"):
        PipelineSettings(split=["net.2"], schedule="bfs")


def test_the_registry_answers_what_the_config_asks_of_each_strategy(tmp_path):
    """What the choice among strategies says and does comes from the strategies' own
    declarations: the choices in order, those that run on several machines, a parameter
    server's restartable workers, the planner's refusal of placement's accumulation."""
    from phalanx import planner

    choices = "auto, plan, single, ddp, towers, fsdp, mesh, pipeline, placement, param_server"
    with pytest.raises(ConfigError, match=f"did you mean .*choose one of {choices}$"):
        strategies.strategy_name(cfg(strategy="singel"))
    with pytest.raises(ConfigError, match="on 2 machines; use parallel.strategy=ddp or fsdp$"):
        strategies.check_nodes(cfg(strategy="towers"), 2)
    served = cfg(strategy="param_server", max_restarts=2, param_server={"servers": 2})
    assert strategies.rejoining(served, 5) == (1, 2)
    assert strategies.rejoining(cfg(strategy="ddp", max_restarts=2), 5) == ()
    assert [n for n, f in strategies.families().items() if f.auto] == ["single", "ddp"]
    with pytest.raises(ConfigError, match="cannot price placement's devices"):
        placed = {"strategy": "placement", "gradient_accumulation": "auto"}
        path = toy.write_config(tmp_path, toy.regression_config(parallel=placed))
        planner.accumulation_for(str(path), [])
    # and of a strategy the plan does not price at all
    served = {"strategy": "param_server", "devices": 2, "gradient_accumulation": "auto"}
    path = toy.write_config(tmp_path, toy.regression_config(parallel=served))
    with pytest.raises(ConfigError, match="the plan does not price param_server; give a number$"):
        planner.accumulation_for(str(path), [])
