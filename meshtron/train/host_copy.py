"""The host copy of a training state that --checkpoint-async writes from
(meshtron/train/async_checkpoint.py): empty tensors shaped like the state's, in shared
memory so that the writer process maps them (pinned where the state is on a GPU, so
that the copies into them are queued on the stream), made once and reused by every save.

Made here rather than by torch's _create_cpu_state_dict, which copies every DTensor to
the host (a blocking device-to-host copy of the whole state, only to have a DTensor on
the CPU to put the buffer in), fills each buffer twice (an empty tensor, then its copy
into shared memory) and hands a 0-dim DTensor back itself. Here each buffer is shared
memory from the start, pinned where it lies (the pinning faults its pages in once), and
a DTensor's host copy is the buffer under the live DTensor's own spec: no byte of the
state is read, so the copy can be made beside the steps (BackgroundSaver.prepare).
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch.distributed.tensor import DTensor


def allocate(state, pin: bool):
    """The host copy's buffers for `state` (tensors, DTensors, nested in dicts, lists
    and tuples); values other than tensors copied as they are."""
    return _copy(state, pin)


def _copy(state, pin: bool):
    if isinstance(state, DTensor):
        return DTensor(buffer(state._local_tensor, pin), state._spec, requires_grad=False)
    if isinstance(state, torch.Tensor):
        return buffer(state, pin)
    if isinstance(state, dict):
        return {k: _copy(v, pin) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(v, pin) for v in state)
    return copy.deepcopy(state)


def buffer(like: torch.Tensor, pin: bool) -> torch.Tensor:
    """An uninitialized contiguous host tensor shaped like `like`, in shared memory,
    page-locked for the GPU's copies when `pin` (unpinned when it is freed)."""
    nbytes = like.numel() * like.element_size()
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))   # a 0-byte shared segment cannot be mapped
    t = torch.empty(0, dtype=like.dtype).set_(storage, 0, like.shape)
    if pin and nbytes:
        ptr = t.data_ptr()
        if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)):   # 1: cudaHostRegisterPortable
            raise RuntimeError(f"could not pin {nbytes} bytes of shared memory for the checkpoint's host copy")
        weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, ptr)
    return t


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
