"""Running a function on several real processes joined by gloo on loopback, for the dist tests."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import torch
import toy

from phalanx import config, strategies, worker
from phalanx.hooks import ComputeStats, Hook
from phalanx.trainer import Trainer

TESTS = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world_size: int,
    target: Callable,
    *args: Any,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """`target(rank, *args)` on `world_size` processes; their results in rank order. A hang or an
    error on any rank fails the caller within `timeout` seconds, and no process is left behind.
    `env` is set in every process over the launcher's variables (LOCAL_RANK=0: ranks share device
    0). A rank that finds the rendezvous port taken starts the run again on another, twice at
    most."""
    for _ in range(2):
        with contextlib.suppress(_PortTaken):
            return _run_ranks_once(world_size, target, args, timeout, env)
    return _run_ranks_once(world_size, target, args, timeout, env)


class _PortTaken(AssertionError):
    """The rendezvous port was taken between its pick and the store's bind (tests run in parallel
    processes each pick ports): the run is started again on another."""


# The ranks are forked from a server process that has imported torch and phalanx once for the
# whole session (what the launcher's server imports, and the trainer), instead of each rank
# starting an interpreter and importing them (seconds each on a 2-core machine, several times a
# test). The server computes nothing, so its forks start clean; each rank is given the test's
# environment and working directory, as a spawned one would be.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["phalanx.preloaded", "phalanx.trainer", "phalanx.strategies"])


def _run_ranks_once(
    world_size: int, target: Callable, args: tuple, timeout: float, env: dict[str, str] | None
) -> list[Any]:
    queue = _CONTEXT.Queue()
    port = free_port()
    parent = dict(os.environ)
    procs = [
        _CONTEXT.Process(
            target=_entry, args=(rank, world_size, port, target, args, queue, parent, env or {})
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                failure = _PortTaken if "EADDRINUSE" in value else AssertionError
                raise failure(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


def _entry(
    rank: int,
    world_size: int,
    port: int,
    target: Callable,
    args: tuple,
    queue,
    parent: dict[str, str],
    env: dict[str, str],
) -> None:
    os.environ.clear()  # the test's environment, not the server's
    os.environ.update(
        {
            **parent,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    torch.set_num_threads(1)
    # NumPy's global generator from fresh entropy, as a spawned rank's is: forks would all
    # start from the server's (Python's own is seeded again on every fork)
    numpy.random.seed()
    succeeded = False
    try:
        queue.put((rank, True, target(rank, *args)))
        succeeded = True
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            # leave together: a group torn down while another rank still talks to it can abort
            if succeeded:
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def strategy_for(cfg: config.Config, carry_through_autograd: bool = False):
    """The strategy the config asks for; with `carry_through_autograd`, the ddp strategy as a torch
    without the reducer's direct entry point runs it. Several ranks on CUDA share GPU 0 over gloo
    (as `run_ranks(..., env={"LOCAL_RANK": "0"})` starts them): nccl refuses two ranks on one
    GPU."""
    shared_gpu = (
        cfg.parallel.accelerator == "cuda"
        and strategies.in_worker()
        and cfg.parallel.strategy in ("auto", "ddp")
    )
    if not (carry_through_autograd or shared_gpu):
        return strategies.create(cfg)
    from phalanx.strategies.ddp import DDP

    ddp = DDP(
        "cuda" if shared_gpu else "cpu",
        None,
        cfg.parallel.sync_batchnorm,
        carry_through_autograd=carry_through_autograd,
        backend="gloo",
    )
    ddp.build_on_device = cfg.parallel.build == "device"
    return ddp


def serve(cfg: config.Config, strategy: Any) -> dict:
    """A parameter server's server: it builds no trainer, as `phalanx train`'s does not."""
    state = worker.build_server(cfg, strategy, [TESTS])
    state.initialise_from()
    strategy.serve(state.engine, state.steps_per_epoch)
    return {"code": 0, "served": True}


def train(raw: dict, carry_through_autograd: bool = False) -> dict:
    """Train a config in this process (one of several, or alone); what the comparisons need."""
    cfg = config.validate(raw)
    record, seen = toy.Record(), toy.SeenIds()
    hooks = [ComputeStats(variables=["loss"], aggregations=["mean", "count"]), record, seen]
    strategy = strategy_for(cfg, carry_through_autograd)
    if strategy.serving:
        return serve(cfg, strategy)
    trainer = Trainer(cfg, None, [TESTS], hooks=hooks, strategy=strategy)
    trainer.initialise_from()  # model.init_from, as a new run of `phalanx train` starts
    assert trainer.run() == 0
    # plain lists: tensors sent between processes live in shared memory that dies with the sender
    # the whole model: gathered to rank 0 where it is sharded
    state = trainer.strategy.model_state()
    state = state.state_dict() if isinstance(state, torch.nn.Module) else state
    params = {k: v.detach().cpu().tolist() for k, v in state.items()}
    progress = getattr(trainer.strategy, "progress", None)  # where the strategy runs collectives
    return {
        "collectives": progress.entered if progress is not None else None,
        "params": params,
        "losses": record.losses,
        "epochs": record.epochs,
        "ids": seen.ids,
        "predictions": seen.predictions,
        "state_bytes": trainer.view.state_bytes(),
        # the model ran through torch.compile: the module it calls is compiled, and dynamo made
        # graphs of it in this process
        "compiled": isinstance(trainer.module, torch._dynamo.eval_frame.OptimizedModule)
        and torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0,
    }


def stop_on_one_rank(
    rank: int, raw: dict, stop_rank: int, stop_step: int, carry_through_autograd: bool = False
) -> dict:
    """Train until rank `stop_rank` asks to stop after step `stop_step`; where this rank ended."""
    cfg = config.validate(raw)
    record = toy.Record()
    strategy = strategy_for(cfg, carry_through_autograd)
    if strategy.serving:
        return serve(cfg, strategy)
    hooks = [record, toy.RequestStopAt(stop_rank, stop_step)]
    trainer = Trainer(cfg, None, [TESTS], hooks=hooks, strategy=strategy)
    code = trainer.run()
    return {"code": code, "step": trainer.step, "losses": record.losses}


def error_lines(rank: int, raw: dict) -> str:
    """Build a trainer of `raw` and expect a ConfigError; its message."""
    from phalanx.errors import ConfigError

    cfg = config.validate(raw)
    try:
        Trainer(cfg, None, [TESTS], hooks=[], strategy=strategies.create(cfg))
    except ConfigError as e:
        return str(e)
    raise AssertionError("the trainer was built")


def epoch_losses(rank: int, raw: dict) -> list[float]:
    """Train with no hook but `toy.EpochLoss`; each epoch's mean training loss."""
    cfg = config.validate(raw)
    means = toy.EpochLoss()
    trainer = Trainer(cfg, None, [TESTS], hooks=[means], strategy=strategies.create(cfg))
    assert trainer.run() == 0
    return means.means


def _logged_lines() -> list[str]:
    """A list that every line phalanx logs from now on (INFO and above) is added to."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("phalanx").addHandler(handler)
    logging.getLogger("phalanx").setLevel(logging.INFO)
    return lines


def profile_lines(rank: int, raw: dict, wait_in_backward: bool | None = None) -> dict:
    """Train with LogProfile; the strategy's sampled backward communication and the lines logged.
    `wait_in_backward`: ddp's, where given."""
    from phalanx.hooks import LogProfile
    from phalanx.strategies.ddp import DDP

    lines = _logged_lines()
    cfg = config.validate(raw)
    strategy = (
        strategies.create(cfg)
        if wait_in_backward is None
        else DDP("cpu", backend="gloo", wait_in_backward=wait_in_backward)
    )
    trainer = Trainer(cfg, None, [TESTS], hooks=[LogProfile()], strategy=strategy)
    assert trainer.run() == 0
    return {"sampled": trainer.strategy.backward_communication(), "lines": lines}


def stop_after_minutes(rank: int, raw: dict) -> dict:
    """StopAfter(minutes=1) whose clock runs out on rank 1 alone, from step 3 on."""
    from phalanx.hooks import StopAfter

    box: list[Trainer] = []

    def clock() -> float:
        return 61.0 if rank == 1 and box and box[0].step >= 3 else 0.0

    cfg = config.validate(raw)
    trainer = Trainer(
        cfg,
        None,
        [TESTS],
        hooks=[StopAfter(minutes=1, clock=clock)],
        strategy=strategies.create(cfg),
    )
    box.append(trainer)
    return {"code": trainer.run(), "step": trainer.step}


def reads_seen(rank: int, raw: dict) -> dict:
    """`train` of toy.CountedRegression, with the training items this rank had read at each
    step's after_batch, and the epoch's data time."""
    cfg = config.validate(raw)
    seen = toy.ReadsSeen()
    profiles: list[dict] = []

    class Profiles(Hook):
        def after_epoch_profile(self, epoch, profile, train_stream, extra_streams) -> None:
            profiles.append(dict(profile))

    trainer = Trainer(cfg, None, [TESTS], hooks=[seen, Profiles()], strategy=strategy_for(cfg))
    assert trainer.run() == 0
    return {"reads": seen.reads, "profiles": profiles}


def train_all(rank: int, raws: list[dict], carry_through_autograd: bool = False) -> list[dict]:
    return [train(raw, carry_through_autograd) for raw in raws]


def run_dir_worker(rank: int, run_dir: str, resume: bool, overrides: list[str]) -> int:
    return worker.run_worker(Path(run_dir), resume, overrides)


def dealt(rank: int, raw: dict) -> dict:
    """Train; this worker's samples by epoch, the last evaluation's figures and the lines
    logged."""
    lines = _logged_lines()
    cfg = config.validate(raw)
    mine = toy.LocalIds()  # no hook reads a step's loss: nothing makes the workers wait
    from phalanx.hooks import ClassificationMetrics

    hooks = [
        ComputeStats(variables=["loss"]),
        ClassificationMetrics(predicted="logits", gold="label"),
        mine,
    ]
    strategy = strategies.create(cfg)
    if strategy.serving:
        return serve(cfg, strategy)
    trainer = Trainer(cfg, None, [TESTS], hooks=hooks, strategy=strategy)
    assert trainer.run() == 0
    return {"ids": mine.epochs[:-1], "metrics": trainer.metrics, "lines": lines}


def wait_for_a_peer_that_never_sends(rank: int, ready: str) -> None:
    """Rank 0 waits in gloo for a message rank 1 never sends, a signal handler that only notes the
    signal installed (as a graceful stop's is while training); rank 1 waits to be ended."""
    import signal
    import time

    import torch.distributed as dist

    from phalanx import signals

    dist.init_process_group("gloo")
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        Path(ready).write_text("waiting")
        with signals.waiting():
            dist.recv(torch.zeros(1), 1)
    else:
        time.sleep(120)


def counted_flops(rank: int, raw: dict) -> dict:
    """Train with LogThroughput; the FLOPs a sample that it counted, and the lines logged."""
    from phalanx.hooks import LogThroughput

    lines = _logged_lines()
    cfg = config.validate(raw)
    hook = LogThroughput()
    trainer = Trainer(cfg, None, [TESTS], hooks=[hook], strategy=strategies.create(cfg))
    assert trainer.run() == 0
    return {"flops": hook.flops_per_sample, "lines": lines}


def summed_split_gradients(rank: int) -> dict:
    """A colwise-split Linear on a replicate 2 x tensor 2 mesh, its gradients set to rank-made
    values and summed over the replicate dimension by `sum_gradients`: each process's local part
    of the sum, and what it should be."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from phalanx.strategies.distributed import sum_gradients

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "tensor"))
    layer = parallelize_module(torch.nn.Linear(3, 4), mesh["tensor"], ColwiseParallel())
    copy = mesh["replicate"].get_local_rank()
    for p in layer.parameters():
        # each copy's gradient: its whole value times (copy + 1); the bias is left without one
        if p.dim() > 1:
            whole = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (copy + 1)
            p.grad = torch.distributed.tensor.distribute_tensor(
                whole, p.device_mesh, p.placements, src_data_rank=None
            )
    sum_gradients(list(layer.parameters()), mesh["replicate"].get_group())
    weight = layer.weight
    expected = torch.arange(weight.numel(), dtype=weight.dtype).reshape(weight.shape) * 3
    return {
        "weight": weight.grad.full_tensor().tolist(),
        "expected": expected.tolist(),
        "bias": layer.bias.grad.full_tensor().tolist(),
        "local_is_shard": tuple(weight.grad.to_local().shape) == (2, 3),
    }


def losses_read_every(rank: int, raw: dict, every: int, *more: Any) -> dict:
    """Train with a hook that reads the loss every `every` steps on rank 0 alone (and the hooks
    `more`); what it saw, the run's exit code and last step, and the agreements the strategy
    ran."""
    cfg = config.validate(raw)
    record = toy.RecordEvery(every)
    hooks = [record, *more]
    trainer = Trainer(cfg, None, [TESTS], hooks=hooks, strategy=strategies.create(cfg))
    code = trainer.run()
    return {
        "code": code,
        "step": trainer.step,
        "losses": record.losses,
        "shown": record.shown,
        "rounds": record.rounds,
        "entered": trainer.strategy.progress.entered,
    }


def nan_checked(rank: int, raw: dict, stop_after: int | None = None) -> dict:
    """Train with StopOnNaN (its defaults: every step's loss), after StopAfter(steps=`stop_after`)
    where given; the exit code, the last step, the agreements the strategy ran, the epochs ended,
    and what the run logged as errors."""
    from phalanx.hooks import StopAfter, StopOnNaN

    cfg = config.validate(raw)
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("phalanx").addHandler(handler)
    hooks = [StopOnNaN()] if stop_after is None else [StopAfter(steps=stop_after), StopOnNaN()]
    trainer = Trainer(cfg, None, [TESTS], hooks=hooks, strategy=strategies.create(cfg))
    try:
        code = trainer.run()
    finally:
        logging.getLogger("phalanx").removeHandler(handler)
    return {
        "code": code,
        "step": trainer.step,
        "entered": trainer.strategy.progress.entered,
        "epochs": trainer.epoch,
        "errors": errors,
    }


def steps_on_one_batch(
    rank: int, raw: dict, steps: int, read: bool, stop_at: int, settle_at: int | None = None
) -> dict:
    """`Trainer.train_step` `steps` times on the first global batch (fetched once), `read` as
    given, rank 1 asking to stop at step `stop_at` (from 0), step `settle_at`'s loss read as soon
    as it returns; each step's `agreed` and `stop`, and its loss once every step has settled."""
    from phalanx import batching, data

    cfg = config.validate(raw)
    trainer = Trainer(cfg, None, [TESTS], hooks=[], strategy=strategies.create(cfg))
    strategy, batch = trainer.strategy, cfg.dataset.batch_size
    plan = data.Plan(range(batch), batch, 1, strategy.data_rank, strategy.data_world_size)
    stream = data.get_stream(trainer.dataset, "train")
    fetched = [(m, batching.collate([stream[i] for i in m.shard])) for m in plan.step(0)]
    outcomes = []
    for k in range(steps):
        outcomes.append(trainer.train_step(fetched, stop=rank == 1 and k == stop_at, read=read))
        if k == settle_at and outcomes[-1].settle is not None:
            outcomes[-1].settle()
    agreed = [o.agreed for o in outcomes]
    for o in reversed(outcomes):  # the last step's settles its window, as a loop's end does
        if o.settle is not None:
            o.settle()
    return {
        "agreed": agreed,
        "stop": [o.stop for o in outcomes],
        "losses": [float(o.loss) for o in outcomes],
    }
