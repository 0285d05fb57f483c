"""A problem that one rank finds stops every rank, with the same message.

Set-up checks that can differ by rank (the tensors a pipeline stage needs from a
checkpoint, its shards of a safetensors file, a file only some hosts can read)
run inside `agree()`: after the block, one all_gather_object tells every rank
whether any failed; if one did, every rank raises the first failing rank's
error before anything else communicates. Without it the failing rank exits and
the others wait in their next collective until the timeout, each with its own
"Connection closed by peer". An agreed error carries `all_ranks = True`, so the
launcher prints it once.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def agree():
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, None if error is None else (type(error), str(error)))
        first = next(((r, f) for r, f in enumerate(found) if f is not None), None)
        if first is not None and (error is None or first[0] != dist.get_rank()):
            cls, message = first[1]
            try:
                error = cls(message)
            except Exception:  # noqa: BLE001 - an exception class with another signature
                error = RuntimeError(message)
            error.add_note(f"(found on rank {first[0]})")
    if error is not None:
        error.all_ranks = True
        raise error
