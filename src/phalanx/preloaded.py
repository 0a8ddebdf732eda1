"""What the launcher's server imports once, before its workers fork from it (`launch.start_method`):
what every worker imports before it trains. Nothing here may touch a GPU: a process forked after
CUDA began cannot use it.

torch's optimizers import torch._dynamo when they are built (several seconds of imports); it is
imported here only where torch has no CUDA: on a GPU machine only torch and phalanx are imported
before the fork, and neither touches the GPU at import.
"""

import sys

# The server runs as `python -c`, whose path starts with the working directory (multiprocessing's
# forkserver does not take the launcher's path before these imports): a file there must not stand
# in for a library that every worker would then share. Each worker gets the launcher's path after.
if sys.argv == ["-c"] and sys.path[:1] == [""]:
    del sys.path[0]

import torch  # noqa: E402
import torch.distributed.elastic.multiprocessing  # noqa: E402, F401 - the workers' entry is torch's
from torch.backends import cuda  # noqa: E402

import phalanx.spawned  # noqa: E402, F401
import phalanx.worker  # noqa: E402, F401

if not cuda.is_built():
    import torch._dynamo  # noqa: F401
