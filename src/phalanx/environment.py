"""Where this process runs, read once from the environment: nothing else in phalanx reads it.

Three ways a process can come to be one of several:
- torch's elastic agent started it: phalanx's own launcher, or `torchrun` (RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT);
- Slurm started it, one task per device (`srun`, no agent): SLURM_PROCID, SLURM_LOCALID,
  SLURM_NODEID, SLURM_NTASKS, SLURM_TASKS_PER_NODE, and the job's first node as the master
  (MASTER_ADDR and MASTER_PORT where the job script sets them; else the port derived from the
  job id);
- neither: it is alone.
The agent's variables win where both are present (`torchrun` inside a Slurm job).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, overload

from phalanx.errors import ConfigError

# set by the launcher for a worker that is started again alone when it dies (param_server's):
# how many processes of this rank died before this one
INCARNATION = "PHALANX_INCARNATION"
# the ranks so started, comma-separated, and how often: "1,2:3"
REJOINS = "PHALANX_REJOINS"
# the launcher's multiprocessing start method, which its workers' own children (DataLoader
# workers) start with, as they would in the launcher's process
START_METHOD = "PHALANX_START_METHOD"


@dataclass(frozen=True)
class Place:
    """This process among the job's: its ranks, the counts, and where the job's store is."""

    launcher: Literal["alone", "agent", "slurm"]
    rank: int = 0
    # among the processes of this machine: which device it takes
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # processes on this machine
    master_addr: str | None = None
    master_port: int | None = None
    # the agent's restarts of this machine's workers so far
    attempt: int = 0
    # a process started in place of one that died: how many died before it
    incarnation: int = 0
    # the agent serves the store the workers share (they are its clients)
    agent_store: bool = False

    @property
    def in_group(self) -> bool:
        """Whether this process is one of several (a launcher started them)."""
        return self.world_size > 1


def here(environ: Mapping[str, str] | None = None) -> Place:
    """This process's place, from `environ` (default: the process's environment)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = _int(env, "WORLD_SIZE")
        return Place(
            "agent",
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK", 0),
            node_rank=_int(env, "GROUP_RANK", 0),
            world_size=world_size,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size),
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT", None),
            attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            incarnation=_int(env, INCARNATION, 0),
        )
    if _int(env, "SLURM_NTASKS", 1) > 1 and "SLURM_PROCID" in env:
        nodes = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        job = _int(env, "SLURM_JOB_ID", 0)
        return Place(
            "slurm",
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            node_rank=_int(env, "SLURM_NODEID", 0),
            world_size=_int(env, "SLURM_NTASKS"),
            local_world_size=tasks_on_this_node(env),
            master_addr=env.get("MASTER_ADDR") or nodes,
            master_port=_int(env, "MASTER_PORT", None) or 20000 + job % 20000,
        )
    return Place("alone")


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def first_host(nodelist: str) -> str | None:
    """The first host of a Slurm node list: `gpu[07-09,12],cpu1` -> `gpu07`."""
    found = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if found is None:
        return None
    prefix, ranges = found.groups()
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def tasks_on_this_node(env: Mapping[str, str]) -> int:
    """Slurm's tasks on this node: SLURM_NTASKS_PER_NODE, or this node's entry of
    SLURM_TASKS_PER_NODE (`4(x2),3`: 4 on each of the first two nodes, then 3)."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    node = _int(env, "SLURM_NODEID", 0)
    for entry in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", entry)
        if found is None:
            break
        count, repeat = int(found.group(1)), int(found.group(2) or 1)
        if node < repeat:
            return count
        node -= repeat
    return _int(env, "SLURM_NTASKS", 1)


@overload
def _int(env: Mapping[str, str], name: str) -> int: ...
@overload
def _int(env: Mapping[str, str], name: str, default: int, /) -> int: ...
@overload
def _int(env: Mapping[str, str], name: str, default: None, /) -> int | None: ...
def _int(env: Mapping[str, str], name: str, *default: int | None) -> int | None:
    """The variable `name` as a whole number; where it is missing, `default` if one is given, else
    a ConfigError."""
    if name not in env:
        if not default:
            raise ConfigError(
                f"the environment variable {name} is missing; the launcher that started this "
                "process set only some of its variables"
            )
        return default[0]
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(
            f"the environment variable {name}={env[name]!r} is not a whole number; "
            "check the launcher's settings"
        ) from None


def nccl_trace_prefix(environ: Mapping[str, str] | None = None) -> str | None:
    """Where NCCL's flight recorder writes each rank's trace on a timeout (the path, before the
    rank)."""
    env = os.environ if environ is None else environ
    return env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
