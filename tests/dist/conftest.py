"""The dist tests run most of their work in processes of their own; what runs in pytest's process
must leave no torch.distributed group there, or a later test in the same process finds one (a
group already made is joined, not waited for)."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_group_left():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group in pytest's process")
