import os

# Before torch is imported: one thread per process (2 cores, up to 8 ranks, and
# a parent that ran a multithreaded op before forking deadlocks its children),
# and the Triton interpreter on machines without a GPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if not os.path.exists("/dev/nvidia0"):   # a GPU machine runs the real kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compileall  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # harness.py, parity.py for tests in subfolders
# meshtron's bytecode, once: the suite starts hundreds of processes, and where
# PYTHONDONTWRITEBYTECODE is set (as on the machines here) each would compile every module again
compileall.compile_dir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "meshtron"),
                       quiet=1)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed.fsdp  # noqa: E402,F401  pre-import so forked workers start warm
import torch.distributed.pipelining  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401

torch.set_num_threads(1)

from harness import Pools  # noqa: E402


@pytest.hookimpl(tryfirst=True)   # before -m selects, so that the slow marks added here count
def pytest_collection_modifyitems(config, items):
    """The fast tier (`-m "not slow"`): a parametrized test marked fast_cases(*ids, **params) runs
    there only the cases named, by id or by parameter values (a tuple: any of them); its other
    cases are marked slow. A named id that is none of the test's cases is an error (a renamed case
    would otherwise leave the fast tier unnoticed), unless the command line picked cases itself."""
    cases = {}
    for item in items:
        mark = item.get_closest_marker("fast_cases")
        if mark is None or not hasattr(item, "callspec"):
            continue
        spec = item.callspec
        fast = spec.id in mark.args or bool(mark.kwargs) and all(
            spec.params.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in mark.kwargs.items())
        if not fast:
            item.add_marker(pytest.mark.slow)
        mark, ids, fast_ids = cases.setdefault((item.path, item.originalname), (mark, set(), set()))
        ids.add(spec.id)
        if fast:
            fast_ids.add(spec.id)
    if any("[" in arg for arg in config.args):
        return
    for (path, name), (mark, ids, fast_ids) in cases.items():
        unknown = [i for i in mark.args if i not in ids]
        if unknown or not fast_ids:
            raise pytest.UsageError(f"{path.name}::{name}: fast_cases {list(mark.args)} {mark.kwargs} name "
                                    f"{'unknown cases ' + str(unknown) if unknown else 'none'} of {sorted(ids)}")


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


def _cpu_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks of every core since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]   # idle, iowait
    return sum(ticks) - idle, idle


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """MESHTRON_TEST_CPU=FILE: one JSON line per test with its wall seconds and the machine's
    busy and idle CPU seconds over it (a test whose cores sat idle waits rather than computes:
    where the suite's time goes, for keeping it short)."""
    path = os.environ.get("MESHTRON_TEST_CPU")
    if not path or not os.path.exists("/proc/stat"):
        yield
        return
    import gc
    import json
    import time
    hz = os.sysconf("SC_CLK_TCK")
    (busy0, idle0), t0 = _cpu_ticks(), time.perf_counter()
    yield
    (busy1, idle1), t1 = _cpu_ticks(), time.perf_counter()
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall_s": round(t1 - t0, 2), "busy_cpu_s": (busy1 - busy0) / hz,
                            "idle_cpu_s": (idle1 - idle0) / hz, "end": round(time.time(), 1),
                            "objects": len(gc.get_objects()),   # the heap a pool forked now would inherit
                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
