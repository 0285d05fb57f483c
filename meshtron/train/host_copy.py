"""The host copy of a training state that --checkpoint-async writes from
(meshtron/train/async_checkpoint.py): empty tensors shaped like the state's, in shared
memory so that the writer process maps them (pinned where the state is on a GPU, so
that the copies into them are queued on the stream), made once and reused by every save.
"""
from __future__ import annotations

import copy

import torch
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor


def allocate(state: dict, pin: bool) -> dict:
    """The host copy's buffers for `state`; values other than tensors copied as they are."""
    return _own_scalars(state, _create_cpu_state_dict(state, pin_memory=pin, share_memory=True))


def _own_scalars(live, host):
    """`host` with a copy in shared memory of each 0-dim tensor of `live`: torch's
    _create_cpu_state_dict hands a 0-dim DTensor back itself (a save would write the value
    it has when the writer reads it, steps later, not the staged one) and makes a plain
    0-dim tensor outside shared memory."""
    if isinstance(live, torch.Tensor) and live.dim() == 0:
        scalar = torch.zeros((), dtype=live.dtype).share_memory_()
        if not isinstance(live, DTensor):
            return scalar
        host = live.to("cpu") if live.device.type != "cpu" else copy.deepcopy(live.detach())
        host._local_tensor = scalar   # torch's own way to give a DTensor a host-side local tensor
        return host
    if isinstance(live, dict):
        return {k: _own_scalars(v, host[k]) for k, v in live.items()}
    if isinstance(live, (list, tuple)):
        return type(live)(_own_scalars(v, h) for v, h in zip(live, host))
    return host


def tensors(obj):
    """Every tensor of a nested state, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)
