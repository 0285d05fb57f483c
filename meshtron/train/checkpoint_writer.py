"""The checkpoint writer process of --checkpoint-async (async_checkpoint.BackgroundSaver
starts one per training process, a fork of a server that imported this module): it
joins the writers' gloo group and writes each state it is sent with dcp.save.

The host copy's tensors reach it once, as shared-memory handles (torch.multiprocessing
pickles a shared tensor as a file descriptor, not its bytes); each save then sends
their indices in that copy (IndexPickler) and its few other values (the step, the
data position). It sees no GPU, ignores Ctrl-C (the training process's to handle) and
dies with the process that started it (lifetime.die_with_parent), and answers each
save with None or the error, made picklable (sendable).
"""
from __future__ import annotations

import datetime
import io
import logging
import os
import pickle
import signal
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshtron.train import checkpoint, lifetime


def serve(conn, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
    """The writer process: joins the writers' group, then writes each state it is sent
    with dcp.save and answers None or the error, until None or the pipe's end."""
    lifetime.die_with_parent("the checkpoint writer's fork server")   # which ends with the training process
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C is the training process's to handle
    os.environ["CUDA_VISIBLE_DEVICES"] = ""   # the copy is in host memory: no CUDA context (GPU memory) here
    # a DTensor's mesh arrives without the job's process groups, and torch warns of each
    # group it does not find here: DCP needs only the mesh's coordinates
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        with open("/proc/self/comm", "w") as f:    # `ps -o pid,comm` names it
            f.write("meshtron-writer")
    except OSError:
        pass
    joined, host = None, []
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the answer to every request
        joined = e
    unusable = None   # why the host copy last sent did not arrive
    while True:
        try:
            request = conn.recv()
        except EOFError:   # the training process closed its end, or is gone
            return
        except Exception as e:  # noqa: BLE001 - a host copy whose handles do not open here: the next save's answer
            unusable = e
            continue
        if request is None:
            return
        if request[0] == "copy":   # the tensors of a new host copy
            host, unusable = request[1], None
            continue
        try:
            if joined is not None:
                raise joined
            if unusable is not None:
                raise unusable
            staged = IndexUnpickler(io.BytesIO(request[1]), host).load()
            dcp.save(staged, checkpoint_id=request[2], process_group=dist.group.WORLD)
            error = None
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one: sent back, raised from wait()
            error = sendable(e)
        staged = request = None
        conn.send(error)


class IndexPickler(pickle.Pickler):
    """Pickles a tensor of the host copy as its index in the copy."""

    def __init__(self, file, indices: dict[int, int]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.indices = indices

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.indices:
                return self.indices[id(obj)]
            if obj.device.type != "cpu":   # the writer must not touch CUDA
                raise checkpoint.CheckpointError(f"a {obj.device} tensor outside the host copy")
        return None


class IndexUnpickler(pickle.Unpickler):
    def __init__(self, file, host: list):
        super().__init__(file)
        self.host = host

    def persistent_load(self, index: int):
        return self.host[index]


def sendable(e: BaseException) -> BaseException:
    """`e` with the writer's traceback as a note, or a RuntimeError that says it where
    `e` cannot be pickled."""
    where = f"in the checkpoint writer process (pid {os.getpid()}):\n" + "".join(traceback.format_exception(e))
    try:
        e.add_note(where)
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}\n{where}")


def first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
