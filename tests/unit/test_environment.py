"""Where a process runs, read from the environment in one place: the elastic agent's variables
(phalanx's launcher, torchrun), Slurm's, or none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx import environment
from phalanx.environment import Place, first_host, here, tasks_on_this_node
from phalanx.errors import ConfigError

AGENT = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2",
    "SLURM_NTASKS": "7",
    "SLURM_TASKS_PER_NODE": "3(x2),1",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_ID": "123456",
}


def test_the_agents_variables():
    assert here(AGENT) == Place(
        "agent",
        rank=5,
        local_rank=1,
        node_rank=1,
        world_size=8,
        local_world_size=4,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    assert here(AGENT).in_group


def test_slurms_variables_with_the_master_on_the_jobs_first_node():
    assert here(SLURM) == Place(
        "slurm",
        rank=6,
        local_rank=0,
        node_rank=2,
        world_size=7,
        local_world_size=1,
        master_addr="gpu07",
        master_port=20000 + 123456 % 20000,
    )
    chosen = here({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "12345"})
    assert (chosen.master_addr, chosen.master_port) == ("head", 12345)


def test_the_agent_wins_inside_a_slurm_job_and_one_task_is_alone():
    assert here({**SLURM, **AGENT}).launcher == "agent"
    assert here({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == Place("alone")
    assert here({}) == Place("alone") and not here({}).in_group


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("node1,node2", "node1"),
        ("a-b-3", "a-b-3"),
        ("n[001]", "n001"),
        ("", None),
    ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_tasks_on_this_node_from_slurms_counts():
    counts = {"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NTASKS": "11"}
    assert [tasks_on_this_node({**counts, "SLURM_NODEID": str(n)}) for n in range(3)] == [4, 4, 3]
    assert tasks_on_this_node({"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "9"}) == 2


def test_a_malformed_or_missing_variable_is_named():
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='two' is not a whole number"):
        here({**AGENT, "WORLD_SIZE": "two"})
    with pytest.raises(ConfigError, match="SLURM_NTASKS=.* is not a whole number"):
        here({**SLURM, "SLURM_NTASKS": "x"})


def test_nothing_else_reads_the_launchers_variables():
    """One place reads them: another reader would disagree with it under some launcher."""
    src = Path(environment.__file__).parent
    names = re.compile(
        r"""environ(?:\.get)?\s*[\[(]\s*["'](RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|"""
        r"""MASTER_ADDR|MASTER_PORT|SLURM_\w+)["']|getenv\(\s*["'](RANK|WORLD_SIZE|SLURM_\w+)"""
        r"""|["'](RANK|WORLD_SIZE|LOCAL_RANK|SLURM_\w+)["']\s+in\s+os\.environ"""
    )
    readers = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if p.name != "environment.py" and names.search(p.read_text())
    )
    assert readers == []
