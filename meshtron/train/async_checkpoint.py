"""--checkpoint-async: a save that holds the step loop only while it copies the state.

`BackgroundSaver.save`, on every rank:
1. waits for the previous save to finish, so two saves never overlap (and the host
   copy below is free to be overwritten);
2. makes `.tmp-step-N` (checkpoint.begin_save: the same directory as a blocking save);
3. copies the training state into host memory: one host copy of this rank's state,
   made once and reused, in shared memory (host_copy.py; pinned where the state lives
   on a GPU, the copies queued on the current stream, so the loop is not held for
   them). The run has it made beside the steps after the first one (`prepare`: a
   thread; allocating and pinning tens of GB took 11-45 s when the first save did it);
4. starts a thread that waits for those copies, hands the copy to this rank's writer
   process, which writes it with DCP, and waits for its answer; save returns: the
   loop goes on.
The thread then meets the other ranks' at a barrier (every rank's shards are on disk)
and rank 0 records, renames and prunes exactly as a blocking save does
(checkpoint.write_record, put_in_place), then tells the others whether it renamed it.
Until that rename the save is a `.tmp-step-N`, which nothing loads and `--resume auto`
never sees, so a job killed while a write is in flight resumes from the previous
checkpoint. Retention runs in that thread, after the rename, while no other save is in
flight: it never touches the one being written. The run's CheckpointManager
(checkpoint_manager.py) waits for the save's thread to end before the closing line and
before the Trainer releases the directory's lock, and `close` stops the writer process.
A save is given the job's --pg-timeout (`timeout_s`), as the collectives of a blocking
one are: a save still unfinished then (a writer that hangs, rank 0's checksums over slow
files) is given up: `wait` and `close` stop the writer, wait for the thread and raise,
and it is never renamed into place. Renaming and giving up are one decision, taken
under a lock (whichever comes first holds): a rank gives its save up on its own while
its shards are being written (it then never reaches the barrier, so rank 0 cannot
publish); past the barrier the decision is rank 0's, the only one that renames, and the
other ranks wait for its word.

Why a process: DCP's planning and serialization are Python, and a writer thread in
this process took the GIL from a host-bound step loop: steps ran slower while a write
was in flight (bench_checkpoint.py measures it). The writer process
(checkpoint_writer.py) holds no GIL of ours, and gets the host copy's tensors once, as
shared-memory handles. The thread left here waits on a pipe and on the barriers, and
does rank 0's publish, which reads every rank's files of the checkpoint back in full
for the CRC32 that meshtron.json records (zlib and file reads let go of the GIL while
they work). The writer sees no GPU; it dies with this
process (lifetime.die_with_parent: a killed job leaves no writer behind, and only
rank 0's publish, here, ever renames a save into place).

The groups: DCP's plan exchange runs among the writer processes, over a gloo group
of theirs (the default group of each writer, rank for rank the job's); the thread's
barriers run here while the step's collectives run in the main thread, and one
process group must never carry two streams of collectives at once (their order
would differ between ranks). So the saver makes one gloo group over all ranks when
it is built (a collective call, at the same point of every rank's set-up), uses it
for nothing else, and over it tells every rank where the writers meet: a store that
rank 0 serves on a port the kernel picked (no window in which another program can
take a port chosen for it).

A test hook (environment, not a flag): MESHTRON_HOLD_SAVE_AT_STEP=N holds the save of step
N for ever once every rank's shards are on disk, before rank 0 renames it into place, after
rank 0 prints `holding the save of step N`: a job killed while a write is in flight,
deterministically.
"""
from __future__ import annotations

import datetime
import io
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from meshtron.config import ConfigError
from meshtron.train import checkpoint, checkpoint_writer, host_copy, lifetime
from meshtron.train.checkpoint_writer import first_line

# A writer is started by a fork server: one interpreter per training process, which
# imports these once; each writer is then a fork of it (milliseconds), where "spawn"
# costs a fresh interpreter and `import torch` per writer (seconds), and "fork" of a
# process with CUDA or gloo threads is unsafe. As with spawn, a writer imports the
# main module: a script that trains needs the `if __name__ == "__main__":` guard, and
# the saver refuses one without it (lifetime.unguarded_main).
_PRELOAD = ["torch", "torch.distributed.checkpoint", checkpoint_writer.__name__]


class BackgroundSaver:
    """Checkpoints written by a background process; one in flight at a time."""

    def __init__(self, timeout_s: float = 600):
        self._hold_at = _held_step()   # the test hook's step, or None
        # the writer would run the script again: train, or hang joining the job. The same
        # script on every rank: each refuses here, before any collective
        unguarded = lifetime.unguarded_main()
        if unguarded is not None:
            error = checkpoint.CheckpointError(
                f"--checkpoint-async starts a writer process, which imports the main module as multiprocessing "
                f"does: put the training in {unguarded} under `if __name__ == \"__main__\":`")
            error.all_ranks = True
            raise error
        self.timeout_s = timeout_s            # the job's --pg-timeout: bounds a save, and the groups' collectives
        timeout = datetime.timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._store, port = None, [None]
        if rank == 0:
            try:
                self._store = _start_store(addr, world, timeout)
                port[0] = self._store.port
            except Exception as e:  # noqa: BLE001 - said on every rank below, not only here
                port[0] = f"{type(e).__name__}: {first_line(e)}"
        if self.group is not None:
            dist.broadcast_object_list(port, src=0, group=self.group)
        if not isinstance(port[0], int):
            error = checkpoint.CheckpointError(f"--checkpoint-async: rank 0 could not start the store where the "
                                               f"checkpoint writers meet ({port[0]})")
            error.all_ranks = True
            raise error
        lifetime.raise_open_files_limit()   # before the fork server starts: the writer inherits it
        # The writer starts here, not at the first save: its start (the first time in a
        # process, a fork server that imports torch: seconds) lengthens the set-up, not
        # the step that saves first, and the writers' group forms while the first steps run.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)   # where this process starts the fork server
        self._conn, theirs = ctx.Pipe()
        self._writer = ctx.Process(target=checkpoint_writer.serve, args=(theirs, addr, port[0], rank, world, timeout_s),
                                   name=f"meshtron-writer-{rank}", daemon=True)
        self._writer.start()
        theirs.close()
        self.writer_pid = self._writer.pid
        self._host: dict | None = None        # the host copy, reused by every save
        self._preparing: threading.Thread | None = None   # making the host copy (prepare)
        self._shm_checked = False             # /dev/shm checked for the copy (once, on every rank)
        self._indices: dict[int, int] | None = None   # id -> index of its tensors, once the writer holds them
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: str | None = None         # the save in flight, or finished and not yet waited for
        self._deadline = 0.0                  # time.monotonic() by which the save in flight must be on disk
        self._decision = threading.Lock()     # publishing and giving up the save: one decision (_settle)
        self._state: str | None = None        # the save in flight: writing, written, then published, given up
                                              # (by this rank) or not published (rank 0's word)
        self.started = 0                      # saves started by this saver

    @property
    def in_flight(self) -> str | None:
        """The path of the save being written, or None."""
        return self._path if self._thread is not None and self._thread.is_alive() else None

    def save(self, root: str, step: int, parts, optimizer, scheduler=None, loader=None, *, keep: int = 3,
             names: dict[int, str] | None = None, **record) -> str:
        """Stage root/step-<step> and start writing it; returns its final path (which
        exists once `wait` returns). `record`: checkpoint.publish's keywords (config,
        layout, model, preset, tokenizer, schedule)."""
        self.wait()
        self._prepared()
        checkpoint._stored(record.get("config"))     # before any collective: a bad config fails alone
        state = checkpoint.saved_state(parts, optimizer, scheduler, loader, step, names)
        if not self._shm_checked:   # a collective: by whether prepare ran, the same on every rank
            self._check_shared_memory(state)
        final, _ = checkpoint.begin_save(root, step)
        staged, copied = self._stage(state)
        self._path, self.started, self._state = final, self.started + 1, "writing"
        self._deadline = time.monotonic() + self.timeout_s
        self._thread = threading.Thread(target=self._write, name=f"meshtron-save-{step}", daemon=True,
                                        args=(staged, copied, root, step, keep, record))
        self._thread.start()
        return final

    def prepare(self, parts, optimizer, scheduler=None, loader=None, names: dict[int, str] | None = None) -> None:
        """Make the host copy now, in a thread beside the steps, so that no save holds
        the loop for it. Call once the state is whole (after the first optimizer step,
        which creates AdamW's moments), at the same step on every rank (it checks
        /dev/shm over every rank). A state whose structure differs at the save is copied
        into buffers made then, as without it."""
        if self._host is not None or self._preparing is not None:
            return
        state = checkpoint.saved_state(parts, optimizer, scheduler, loader, 0, names)
        self._check_shared_memory(state)
        cuda = [t.device for t in host_copy.tensors(state) if t.device.type == "cuda"]

        def make():
            try:
                if cuda:   # this thread's CUDA calls go to the training device, not to device 0
                    torch.cuda.set_device(cuda[0])
                self._host = host_copy.allocate(state, pin=bool(cuda))
            except Exception:  # noqa: BLE001 - the first save makes the copy itself and says what fails, as before
                self._host = None

        self._preparing = threading.Thread(target=make, name="meshtron-host-copy", daemon=True)
        self._preparing.start()

    def _prepared(self) -> None:
        """Wait for `prepare`'s thread (a rank raising here alone would leave the others
        in the save's collectives: a copy it failed to make is made by the save, as
        without `prepare`)."""
        if self._preparing is not None:
            self._preparing.join()

    def wait(self) -> str | None:
        """Block until the save in flight is settled and its thread has ended; returns its
        path, in place (None when no save was waiting to be collected). A failed write
        raises its error here, and a save given up (still unfinished `timeout_s` after it
        started, its writer stopped) or that rank 0 did not publish raises saying so."""
        if self._thread is None:
            return None
        try:
            self._join()
        finally:
            if not self._thread.is_alive():   # else (an interrupted wait) close joins it
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

    def close(self) -> None:
        """Stop the writer process, after the save in flight (`wait` first to see its
        error; a save past its time raises here too); never hangs on a hung writer, safe
        to repeat."""
        try:
            if self._thread is not None:
                self._join()
        finally:
            self._thread = None
            if self._preparing is not None:   # not left pinning memory as the process ends
                self._preparing.join()
            self._stop_writer()

    def _join(self) -> None:
        """Wait for the saver's thread until the save's deadline. Past it, give the save up
        where this rank still may and stop the writer (a hung one holds the thread on its
        pipe); then wait for the thread to end, so that no thread of the save touches the
        directory once this returns (the Trainer releases the directory's lock after it).
        Its remaining waits are bounded: the collectives by the saver group's timeout."""
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._thread.is_alive() and self._give_up():
            self._writer.kill()
            self._writer.join(timeout=10)
        self._thread.join()
        name = os.path.basename(self._path)
        if self._state == "given up":
            raise checkpoint.CheckpointError(
                f"the background write of {name} did not finish within {self.timeout_s:.0f} s (--pg-timeout); its "
                f"writer process (pid {self.writer_pid}) was stopped, and the save was not published: the previous "
                "complete checkpoint stays the newest")
        if self._state == "not published":
            raise checkpoint.CheckpointError(f"rank 0 did not publish the background save of {name} (its error "
                                             "says why): the previous complete checkpoint stays the newest")

    def _give_up(self) -> bool:
        """Past the deadline: give the save up unless it is settled. Any rank may while its
        shards are being written; once they are on every rank's disk only rank 0 may (it
        alone renames), and the others learn its decision."""
        return self._settle("writing", "given up") or (checkpoint._rank() == 0 and self._settle("written", "given up"))

    def _settle(self, before: str, after: str) -> bool:
        """Move the save in flight from `before` to `after`, unless another thread moved it
        first: the thread's move to published and the caller's to given up exclude each other."""
        with self._decision:
            if self._state != before:
                return False
            self._state = after
            return True

    def _stop_writer(self) -> None:
        if self._conn.closed:
            return
        try:
            self._conn.send(None)
        except OSError:   # already gone
            pass
        self._writer.join(timeout=10)
        if self._writer.is_alive():   # stuck, e.g. in a collective with a writer that failed
            self._writer.kill()
            self._writer.join()
        self._conn.close()
        self._store = None

    def _check_shared_memory(self, state: dict) -> None:
        """Refuse, on every rank at once, a host copy that /dev/shm cannot hold: a tmpfs
        written past its size ends the process with SIGBUS, without a word (a container's
        default /dev/shm is 64 MiB). This node's ranks are counted as holding this rank's
        share each."""
        need = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in host_copy.tensors(state))
        need *= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        try:
            st = os.statvfs("/dev/shm")
            free = st.f_bavail * st.f_frsize
        except OSError:   # no /dev/shm to ask (not Linux): torch says what fails, if anything
            free = need
        ok = torch.tensor([float(free >= need), need / 2**30, free / 2**30])
        if self.group is not None:
            worst = ok.clone()
            dist.all_reduce(worst, op=dist.ReduceOp.MIN, group=self.group)
            ok[0] = worst[0]
        if not ok[0]:
            error = checkpoint.CheckpointError(
                f"--checkpoint-async keeps a copy of the training state in shared memory (/dev/shm): "
                f"{ok[1]:.1f} GiB on this node, and /dev/shm has {ok[2]:.1f} GiB free on "
                f"{'this' if free < need else 'another'} rank's node; give it more (docker run --shm-size, "
                "a Kubernetes memory-backed emptyDir on /dev/shm) or save without --checkpoint-async")
            error.all_ranks = True   # every rank refuses at the same point
            raise error
        self._shm_checked = True

    def _stage(self, state: dict) -> tuple[dict, torch.cuda.Event | None]:
        """A host copy of `state` (tensors copied into the cached buffers, everything else
        copied by value) and, on a GPU, the event after which the copies are complete."""
        cuda = any(t.device.type == "cuda" for t in host_copy.tensors(state))
        for fresh in (False, True):
            if self._host is None or fresh:
                self._host = host_copy.allocate(state, pin=cuda)
                self._indices = None
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

    def _write(self, staged: dict, copied, root: str, step: int, keep: int, record: dict) -> None:
        try:
            if copied is not None:
                copied.synchronize()             # the writer reads the copy only once it is complete
            self._write_shards(staged, os.path.join(root, f".tmp-step-{step:08d}"))
            if not self._settle("writing", "written"):   # given up: kept from the barrier, no rank publishes it
                return
            self._collective(self._barrier, "was not published: not every rank's write finished")   # all on disk
            if step == self._hold_at:
                _hold(step)
            self._publish(root, step, keep, record)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = e

    def _publish(self, root: str, step: int, keep: int, record: dict) -> None:
        """Rank 0 records the files, then renames the save into place unless it was given
        up meanwhile; every rank learns from it which (its wait reports it)."""
        published, error = False, None
        if checkpoint._rank() == 0 and self._state == "written":   # not given up already: record the files
            try:
                checkpoint.write_record(root, step, **record)
                published = self._settle("written", "published")
                if published:
                    checkpoint.put_in_place(root, step, keep, record.get("config"))
            except Exception as e:  # noqa: BLE001 - raised once the other ranks know
                error = e
        said = self._collective(lambda: self._rank0_says(published), "is published or not as rank 0 decided, "
                                "whose word did not come")
        if checkpoint._rank() != 0:
            self._settle("written", "published" if said else "not published")
        if error is not None:
            raise error

    def _rank0_says(self, published: bool) -> bool:
        """Rank 0's `published`, on every rank."""
        if self.group is None:
            return published
        flag = torch.tensor([int(published)])
        dist.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def _collective(self, call, failed: str):
        """call() on the saver's group; gloo's error (a peer that gave its save up never
        comes: the group's timeout) said in one line."""
        try:
            return call()
        except RuntimeError as e:
            raise checkpoint.CheckpointError(f"the background save of {os.path.basename(self._path)} {failed} "
                                             f"within {self.timeout_s:.0f} s (--pg-timeout): {first_line(e)}") from e

    def _write_shards(self, staged: dict, path: str) -> None:
        """This rank's shards of `staged` into `path`, by the writer process (dcp.save).
        The host copy's tensors go to the writer once, as shared-memory handles (a file
        descriptor each); a save then sends its other values and, for each tensor, its
        index in the copy the writer holds."""
        try:
            if self._indices is None:
                tensors = list(host_copy.tensors(self._host))
                self._conn.send(("copy", tensors))
                self._indices = {id(t): i for i, t in enumerate(tensors)}
            data = io.BytesIO()
            checkpoint_writer.IndexPickler(data, self._indices).dump(staged)
            self._conn.send(("save", data.getvalue(), path))
            error = self._conn.recv()
        except (EOFError, OSError) as e:
            self._writer.join(timeout=5)
            raise checkpoint.CheckpointError(f"the checkpoint writer process (pid {self.writer_pid}) is gone "
                                             f"(exit code {self._writer.exitcode})") from e
        if error is not None:   # the writer's own error, said in one line; its traceback is a note
            failed = checkpoint.CheckpointError(f"the background save to {path} failed in the writer process "
                                                f"(pid {self.writer_pid}): {type(error).__name__}: "
                                                f"{first_line(error)}")
            # DCP gathers every rank's failure and raises it on every rank (a BaseException,
            # which one_line_errors would not catch): said once
            failed.all_ranks = isinstance(error, CheckpointException)
            for note in getattr(error, "__notes__", []):   # the writer's traceback, for a reader of the whole error
                failed.add_note(note)
            raise failed from error

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def _held_step() -> int | None:
    """MESHTRON_HOLD_SAVE_AT_STEP's step (the module's docstring), or None."""
    value = os.environ.get("MESHTRON_HOLD_SAVE_AT_STEP")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"MESHTRON_HOLD_SAVE_AT_STEP={value!r} must be a positive integer")
    return int(value)


def _hold(step: int) -> None:
    if checkpoint._rank() == 0:
        print(f"holding the save of step {step}", flush=True)
    threading.Event().wait()   # never set: until the job is killed


def _start_store(addr: str, world: int, timeout: datetime.timedelta):
    """Rank 0's store where the writers meet, on a port the kernel picks (port 0)."""
    return dist.TCPStore(addr, 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
