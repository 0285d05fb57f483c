import os

# Before torch is imported: one thread per process (2 cores, up to 8 ranks, and
# a parent that ran a multithreaded op before forking deadlocks its children),
# and the Triton interpreter on machines without a GPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if not os.path.exists("/dev/nvidia0"):   # a GPU machine runs the real kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # harness.py, parity.py for tests in subfolders

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed.fsdp  # noqa: E402,F401  pre-import so forked workers start warm
import torch.distributed.pipelining  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401

torch.set_num_threads(1)

from harness import Pools  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
