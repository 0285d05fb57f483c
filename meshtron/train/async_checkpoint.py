"""--checkpoint-async: a save that holds the step loop only while it copies the state.

`BackgroundSaver.save`, on every rank:
1. waits for the previous save to finish, so two saves never overlap (and the host
   copy below is free to be overwritten);
2. makes `.tmp-step-N` (checkpoint.begin_save: the same directory as a blocking save);
3. copies the training state into host memory: one host copy of this rank's state,
   allocated at the first save and reused (pinned where the state lives on a GPU,
   the copies queued on the current stream, so the loop is not held for them);
4. starts a thread that writes the copy with DCP, over a gloo group of its own, and
   returns: the loop goes on.
The thread then meets the other ranks' at a barrier (every rank's shards are on disk)
and rank 0 records, renames and prunes exactly as a blocking save does
(checkpoint.publish), then one more barrier. Until that rename the save is a
`.tmp-step-N`, which nothing loads and `--resume auto` never sees, so a job killed
while a write is in flight resumes from the previous checkpoint. Retention runs in
that thread, after the rename, while no other save is in flight: it never touches
the one being written. The Trainer waits for the writer before it releases the
directory's lock and before its closing line.

The group: DCP's plan exchange and the barriers run in the thread while the step's
collectives run in the main thread, and one process group must never carry two
streams of collectives at once (their order would differ between ranks). So the
saver makes one gloo group over all ranks when it is built (a collective call, at
the same point of every rank's set-up), and uses it for nothing else.
"""
from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

from meshtron.train import checkpoint


class BackgroundSaver:
    """Checkpoints written by a background thread; one in flight at a time."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._host: dict | None = None        # the host copy, reused by every save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: str | None = None         # the save in flight, or finished and not yet waited for
        self.started = 0                      # saves started by this saver

    @property
    def in_flight(self) -> str | None:
        """The path of the save being written, or None."""
        return self._path if self._thread is not None and self._thread.is_alive() else None

    def save(self, root: str, step: int, parts, optimizer, scheduler=None, loader=None, *, keep: int = 3,
             names: dict[int, str] | None = None, before_publish=None, **record) -> str:
        """Stage root/step-<step> and start writing it; returns its final path (which
        exists once `wait` returns). `record`: checkpoint.publish's keywords (config,
        layout, model, preset, tokenizer). `before_publish(step)`, if given, runs in the
        writer on every rank once every rank's shards are on disk, before rank 0
        renames them into place (a test's way to hold a write in flight)."""
        self.wait()
        checkpoint._stored(record.get("config"))     # before any collective: a bad config fails alone
        final, _ = checkpoint.begin_save(root, step)
        staged, copied = self._stage(checkpoint.saved_state(parts, optimizer, scheduler, loader, step, names))
        self._path, self.started = final, self.started + 1
        self._thread = threading.Thread(target=self._write, name=f"meshtron-save-{step}", daemon=True,
                                        args=(staged, copied, root, step, keep, record, before_publish))
        self._thread.start()
        return final

    def wait(self) -> str | None:
        """Block until the save in flight is on disk; returns its path (None when no
        save was waiting to be collected). A failed write raises its error here."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, path, self._path = None, self._path, None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return path

    def poll(self) -> str | None:
        """The path of a save that has finished since the last call, else None; never blocks."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()

    def _stage(self, state: dict) -> tuple[dict, torch.cuda.Event | None]:
        """A host copy of `state` (tensors copied into the cached buffers, everything else
        copied by value) and, on a GPU, the event after which the copies are complete."""
        cuda = any(t.device.type == "cuda" for t in _tensors(state))
        for fresh in (False, True):
            if self._host is None or fresh:
                self._host = _create_cpu_state_dict(state, pin_memory=cuda)
            try:
                staged = _copy_state_dict(state, self._host, non_blocking=cuda, type_check=False)
                break
            except CompanionMismatch:   # the state's structure changed since the buffers were made
                self._host = None
        copied = None
        if cuda:
            copied = torch.cuda.Event()
            copied.record()
        return staged, copied

    def _write(self, staged: dict, copied, root: str, step: int, keep: int, record: dict, before_publish) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            dcp.save(staged, checkpoint_id=os.path.join(root, f".tmp-step-{step:08d}"), process_group=self.group)
            self._barrier()                      # every rank's shards are on disk
            if before_publish is not None:
                before_publish(step)
            if checkpoint._rank() == 0:
                checkpoint.publish(root, step, keep, **record)
            self._barrier()                      # and the checkpoint is in place, for every rank's wait
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = e

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)

