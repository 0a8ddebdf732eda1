"""What the launcher's server imports once, before its workers fork from it (`launch.start_method`):
what every worker imports before it trains. Nothing here may touch a GPU: a process forked after
CUDA began cannot use it.

torch's optimizers import torch._dynamo when they are built (several seconds of imports); it is
imported here only where torch has no CUDA, so that on a GPU machine nothing but torch's own
import runs before the fork.
"""

import torch
import torch.distributed.elastic.multiprocessing  # noqa: F401 - the workers' entry is torch's
from torch.backends import cuda

import phalanx.spawned  # noqa: F401
import phalanx.worker  # noqa: F401

if not cuda.is_built():
    import torch._dynamo  # noqa: F401
