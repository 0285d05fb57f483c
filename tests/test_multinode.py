"""Several machines: two launcher processes ("nodes": torchrun, then meshtron-run) of two ranks each meet at
one rendezvous endpoint, as docs/parallelism.md's multi-node commands do; tp stays inside
a node and HSDP puts its replicas across nodes. Losses equal one process's."""
import json
import os
import socket
import subprocess
import sys

import pytest

from harness import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--model", "tiny", "--seq-len", "32", "--steps", "3", "--global-batch", "8", "--log-interval", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(flags, metrics, launcher):
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", launcher, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "meshtron-test", "--node-rank", str(node),
         os.path.join(ROOT, "recipes", "train.py")] + ARGS + flags + (["--metrics-file", metrics] if node == 0 else []),
        env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    return [r["loss"] for r in map(json.loads, open(metrics)) if "loss" in r]


# each launcher once: torchrun's workers start as new interpreters, meshtron-run's are forked
@pytest.mark.parametrize("flags,launcher",
                         [(["--dp", "2", "--tp", "2", "--sp", "--zero", "3", "--micro-batch", "4"],
                           "torch.distributed.run"),
                          (["--dp", "4", "--hsdp", "2", "--zero", "3", "--micro-batch", "2"], "meshtron.launch")],
                         ids=["dp2-across-nodes-x-tp2-inside", "hsdp-replicas-across-nodes"])
@pytest.mark.slow
def test_two_nodes_meet_at_one_rendezvous(pools, tmp_path, flags, launcher):
    losses = two_nodes(flags, str(tmp_path / "m.jsonl"), launcher)
    one = pools.run(1, train, ARGS + ["--micro-batch", "8"])[0]
    assert losses == pytest.approx(one, rel=1e-5)
