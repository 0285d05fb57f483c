"""--checkpoint-async (issue 44, section 1): the state is copied to host memory, the
loop goes on and a writer process of each rank writes it. What a blocking save guarantees
must hold: the same checkpoint, tensor for tensor; exact resume; a save in flight
when the job is killed never loads, and --resume auto takes the previous one; two
saves never overlap; retention never removes the one being written; the directory's
lock is held until the writer finishes; the closing line waits for the last save; the
write runs in another process, which a killed job does not leave behind; a writer that
hangs is stopped once the save's time (the job's --pg-timeout) is up, and a failure
anywhere (the writer, rank 0's store, a script without the main guard) is one line.
Liveness is polled with a deadline; no timing is asserted."""
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_checkpoint import COMMON, LAYOUTS, run
from test_job_lifetime import (
    DP2,
    FORKED,
    TINY,
    TORCHRUN,
    _alive,
    _children,
    _env,
    _kill_agent,
    _wait_for,
    _wait_for_line,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from meshtron.models import GPT, gpt_config
from meshtron.train import checkpoint
from meshtron.train.optim import build_optimizer

from harness import mesh, train

ASYNC = ["--checkpoint-async"]


def _stored(path: str, out: str) -> dict:
    """Everything a checkpoint holds (every rank's RNG, whole tensors), read back by DCP
    (through the file `out`)."""
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _equal(a, b, where="") -> list[str]:
    """Where two nested states differ (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in _equal(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal(x, y, f"{where}.{i}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _fresh_load(path: str):
    """The checkpoint loaded into a fresh one-process model and its AdamW: (model, optimizer, step)."""
    cfg = gpt_config("tiny", tie_embeddings=False)
    model = GPT(cfg, seed=123)                    # other weights than the run's: all must come from the file
    optimizer = build_optimizer([model], 1e-3)
    step = checkpoint.load(path, [model], optimizer, config=cfg)
    return model, optimizer, step


@pytest.mark.slow
def test_an_async_save_equals_a_blocking_one_and_resumes_exactly(pools, tmp_path):
    sync, asy, resumed = (str(tmp_path / d) for d in ("sync", "async", "resumed"))
    straight = run(pools, "dp2-zero3")
    assert run(pools, "dp2-zero3", "--checkpoint-dir", sync, "--checkpoint-interval", "3") == straight
    # the write of step 3 waits until step 4 has changed every weight: what it writes must be the staged copy
    argv = COMMON + LAYOUTS["dp2-zero3"][1] + ["--checkpoint-dir", asy, "--checkpoint-interval", "3", *ASYNC]
    losses, writes, _ = pools.run(2, _slow_writes, argv, timeout=300)[0]
    assert losses == straight
    assert [(w["step"], w.get("loop_went_on")) for w in writes] == [(3, True), (6, None)]
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(asy)] == ["step-00000003", "step-00000006"]
    for step in ("step-00000003", "step-00000006"):
        a, b = os.path.join(sync, step), os.path.join(asy, step)
        checkpoint.validate(b)
        # every stored item, each rank's RNG and the data position included
        assert _equal(_stored(a, str(tmp_path / "a.pt")), _stored(b, str(tmp_path / "b.pt"))) == []
        (ma, oa, sa), (mb, ob, sb) = _fresh_load(a), _fresh_load(b)
        assert sa == sb == int(step[-8:])
        assert _equal(ma.state_dict(), mb.state_dict()) == []
        assert _equal(oa.state_dict(), ob.state_dict()) == []
        assert len(oa.state_dict()["state"]) == len(list(ma.parameters()))   # the AdamW state was compared
    # killed after step 3's async save (exit_after), resumed with async saves: the same losses
    first = run(pools, "dp2-zero3", "--checkpoint-dir", resumed, "--checkpoint-interval", "3", *ASYNC, exit_after=3)
    second = run(pools, "dp2-zero3", "--checkpoint-dir", resumed, "--checkpoint-interval", "3", "--resume", "auto",
                 *ASYNC)
    assert first + second == straight


@pytest.mark.parametrize("layout", ["pp2", "tp2-sp"])
@pytest.mark.fast_cases("pp2")
def test_async_saves_resume_exactly_under_other_layouts(pools, tmp_path, layout):
    # a pipeline rank saves its stages (the tied weight's copy under its first name), TP its shards
    straight = run(pools, layout)
    ck = ["--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", *ASYNC]
    first = run(pools, layout, *ck, exit_after=4)       # step 3's save, step 4 trained while it may be written
    second = run(pools, layout, *ck, "--resume", "auto")
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "step-00000003", "step-00000006"]
    assert first == straight[:4] and second == straight[3:]


def _in_the_writer(rank, world, argv):
    """Train with async saves while dcp.save refuses to run in this process. Returns
    (this pid, the writer's pid and name, whether every tensor of the host copy is in
    shared memory, the shapes of tensors a save sent by value, whether the writer is
    gone after the run, the losses, the threads that made a host copy)."""
    import torch.distributed.checkpoint as dcp

    from meshtron import Config, Trainer, models
    from meshtron.train import checkpoint_writer as cw
    from meshtron.train import host_copy

    def refuse(*args, **kwargs):
        raise AssertionError("dcp.save ran in the training process")

    by_value, index, real = [], cw.IndexPickler.persistent_id, dcp.save

    def watched(pickler, obj):
        found = index(pickler, obj)
        if isinstance(obj, torch.Tensor) and found is None:
            by_value.append(tuple(obj.shape))
        return found

    made, allocate = [], host_copy.allocate

    def recorded(state, pin):
        made.append(threading.current_thread().name)
        return allocate(state, pin)

    dcp.save, cw.IndexPickler.persistent_id, host_copy.allocate = refuse, watched, recorded
    try:
        trainer = Trainer(Config.from_args(argv, models=models.PRESETS), verbose=False)
        pid = trainer.checkpoints.saver.writer_pid
        deadline = time.monotonic() + 60            # it names itself first thing
        while _name(pid) != "meshtron-writer" and time.monotonic() < deadline:
            time.sleep(0.01)
        name = _name(pid)
        losses = trainer.train()      # and closes the saver, which stops the writer
    finally:
        dcp.save, cw.IndexPickler.persistent_id, host_copy.allocate = real, index, allocate
    local = [t.to_local() if isinstance(t, DTensor) else t for t in host_copy.tensors(trainer.checkpoints.saver._host)]
    shared = all(t.is_shared() for t in local)
    return os.getpid(), pid, name, shared, by_value, not _alive(pid), losses, made


def test_the_write_runs_in_a_writer_process_that_gets_the_copy_by_handle(pools, tmp_path):
    argv = COMMON + LAYOUTS["dp2-zero3"][1] + ["--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", *ASYNC]
    straight = run(pools, "dp2-zero3")
    for ours, writer, name, shared, by_value, gone, losses, made in pools.run(2, _in_the_writer, argv, timeout=300):
        assert writer != ours and name == "meshtron-writer"
        assert shared and by_value == []    # the host copy went once, as handles; saves send indices into it
        assert gone and losses == straight
        assert made == ["meshtron-host-copy"]   # made once, beside the steps, not by the first save
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "step-00000003", "step-00000006"]
    checkpoint.validate(str(tmp_path / "step-00000006"))


def _a_failed_prepare(rank, world, argv):
    """Train with async saves where rank 1 fails to make the host copy beside the steps:
    the threads that made a copy on this rank, and the losses."""
    from meshtron.train import host_copy
    made, real = [], host_copy.allocate

    def flaky(state, pin):
        made.append(threading.current_thread().name)
        if rank == 1 and len(made) == 1:
            raise OSError("cannot pin")
        return real(state, pin)

    host_copy.allocate = flaky
    try:
        return made, train(rank, world, argv)
    finally:
        host_copy.allocate = real


def test_a_host_copy_not_made_beside_the_steps_is_made_by_the_first_save(pools, tmp_path):
    # raising on the one rank would leave the other in the save's collectives
    argv = COMMON + LAYOUTS["dp2-zero3"][1] + ["--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", *ASYNC]
    (made0, losses0), (made1, losses1) = pools.run(2, _a_failed_prepare, argv, timeout=300)
    assert made0 == ["meshtron-host-copy"] and made1 == ["meshtron-host-copy", "MainThread"], (made0, made1)
    assert losses0 == losses1 and len(losses0) == 6
    checkpoint.validate(str(tmp_path / "step-00000006"))


def _a_failed_write(rank, world, blocked):
    """A write into a path the writer cannot make: what wait() would raise, and whether
    close stops the writer."""
    from meshtron.train.async_checkpoint import BackgroundSaver

    saver = BackgroundSaver(timeout_s=60)
    try:
        saver._write_shards({"w": torch.ones(3)}, os.path.join(blocked, "ck"))
        raised = None
    except BaseException as e:  # noqa: BLE001 - the test reads it
        raised = (type(e).__name__, str(e), "".join(getattr(e, "__notes__", [])))
    saver.close()
    return raised, saver.writer_pid, _alive(saver.writer_pid)


def test_the_writers_error_is_raised_here_and_close_stops_the_writer(pools, tmp_path):
    blocked = tmp_path / "a-file"       # a directory cannot be made under it
    blocked.write_text("")
    raised, pid, alive = pools.run(1, _a_failed_write, str(blocked))[0]
    assert raised is not None and str(blocked) in raised[1] + raised[2], raised
    assert f"in the checkpoint writer process (pid {pid})" in raised[1] + raised[2], raised
    assert not alive


def _a_hung_writer(rank, world, root, close_only):
    """A writer that is alive but never answers (stopped): what wait (or close, without
    wait) raises once the save's time is up, and whether the writer is gone then."""
    from meshtron.train.async_checkpoint import BackgroundSaver

    model = torch.nn.Linear(2, 2)
    saver = BackgroundSaver(timeout_s=2)
    os.kill(saver.writer_pid, signal.SIGSTOP)
    saver.save(root, 1, [model], torch.optim.SGD(model.parameters(), lr=0.1))
    raised = None
    try:
        saver.close() if close_only else saver.wait()
    except checkpoint.CheckpointError as e:
        raised = str(e)
    saver.close()
    return raised, _alive(saver.writer_pid), checkpoint.list_checkpoints(root)


@pytest.mark.parametrize("close_only", [False, True])
@pytest.mark.fast_cases(close_only=False)
def test_a_writer_that_hangs_is_stopped_after_the_timeout(pools, tmp_path, close_only):
    raised, alive, complete = pools.run(1, _a_hung_writer, str(tmp_path), close_only)[0]
    assert raised is not None and "\n" not in raised, raised
    assert "step-00000001 did not finish within 2 s" in raised and "previous complete checkpoint" in raised, raised
    assert not alive and complete == []


def _a_barrier_alone(rank, world):
    """Rank 0 alone at a barrier of the saver's group: how it ends within the pool's timeout."""
    from meshtron.train.async_checkpoint import BackgroundSaver

    saver = BackgroundSaver(timeout_s=2)
    try:
        if rank == 0:
            saver._barrier()
        return None
    except RuntimeError as e:
        return type(e).__name__
    finally:
        saver.close()


def test_the_savers_group_has_the_jobs_timeout(pools):
    # gloo's default is 30 minutes: a rank whose peer's writer failed would wait that long
    assert pools.run(2, _a_barrier_alone, timeout=60)[0] is not None


def _a_store_that_does_not_start(rank, world):
    import meshtron.train.async_checkpoint as ac

    def refused(*args):
        raise OSError("[Errno 98] Address already in use")

    real, ac._start_store = ac._start_store, refused
    try:
        ac.BackgroundSaver(timeout_s=60).close()
        return None
    except checkpoint.CheckpointError as e:
        return str(e), getattr(e, "all_ranks", False)
    finally:
        ac._start_store = real


def test_rank_0s_store_failing_to_start_stops_every_rank(pools):
    for raised in pools.run(2, _a_store_that_does_not_start, timeout=60):
        assert raised is not None and raised[1], raised
        assert "rank 0 could not start the store" in raised[0] and "Address already in use" in raised[0], raised


class _Unloadable:
    """Pickles in the training process; unpickling it (in the writer) raises ValueError."""

    def __reduce__(self):
        return int, ("not a number",)


def _an_unloadable_host_copy(rank, world, path):
    from meshtron.train.async_checkpoint import BackgroundSaver

    saver = BackgroundSaver(timeout_s=60)
    try:
        saver._conn.send(("copy", [_Unloadable()]))
        saver._indices = {}
        saver._write_shards({"step": 1}, path)
        return None
    except checkpoint.CheckpointError as e:
        return str(e), _alive(saver.writer_pid)
    finally:
        saver.close()


def test_a_host_copy_the_writer_cannot_unpickle_says_the_writers_error(pools, tmp_path):
    raised, alive = pools.run(1, _an_unloadable_host_copy, str(tmp_path / "ck"))[0]
    assert "ValueError: invalid literal for int()" in raised and "\n" not in raised, raised
    assert alive     # it answered, rather than died


def _scalars_staged_then_changed(rank, world, root):
    """A state with 0-dim tensors (a DTensor among them) staged, then changed in place
    before the writer reads the copy (the loop goes on): what a load of the background
    save and of a blocking save of the staged values give, and the values staged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshtron.train.async_checkpoint import BackgroundSaver

    dp = mesh(dp=2)["dp"]

    def state(w, count, step):
        return {"w": distribute_tensor(w, dp, [Shard(0)]), "count": distribute_tensor(count, dp, [Replicate()]),
                "step": step, "n": 7}

    live = state(torch.arange(8.0), torch.tensor(3.0), torch.tensor(5))
    saver = BackgroundSaver(timeout_s=60)
    try:
        staged, _ = saver._stage(live)
        for t in (live["w"].to_local(), live["count"].to_local(), live["step"]):
            t.add_(100)
        saver._write_shards(staged, os.path.join(root, "background"))
    finally:
        saver.close()
    dcp.save(state(torch.arange(8.0), torch.tensor(3.0), torch.tensor(5)), checkpoint_id=os.path.join(root, "blocking"))
    loaded = []
    for name in ("background", "blocking"):
        into = state(torch.zeros(8), torch.tensor(0.0), torch.tensor(0))
        dcp.load(into, checkpoint_id=os.path.join(root, name))
        loaded.append((into["w"].full_tensor(), into["count"].full_tensor(), into["step"], into["n"]))
    return loaded


def test_0_dim_tensors_and_dtensors_are_copied_and_reload_equal(pools, tmp_path):
    # torch's host-copy helper hands a 0-dim DTensor back itself: the write would see the later value
    background, blocking = pools.run(2, _scalars_staged_then_changed, str(tmp_path))[0]
    assert _equal(background, blocking) == []
    w, count, step, n = background
    assert torch.equal(w, torch.arange(8.0)) and count.item() == 3.0 and step.item() == 5 and n == 7


def test_a_script_without_the_main_guard_is_refused_in_one_line(tmp_path):
    # the writer imports the main module as multiprocessing does: it would train too, or hang joining the job
    script = tmp_path / "unguarded.py"
    script.write_text("from meshtron.train.async_checkpoint import BackgroundSaver\n"
                      "from meshtron.train.lifetime import one_line_errors\n\n"
                      "one_line_errors(lambda: BackgroundSaver(timeout_s=30).close())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, str(script)], env=_env() | {"PYTHONPATH": root}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == "", out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and f"{script}:4 under `if __name__ == \"__main__\":`" in out.stderr, \
        out.stderr


def _host_copy_of_meta_state(rank, world):
    """host_copy.allocate of a state on the meta device, which has no bytes to read."""
    from torch.distributed.tensor import Shard

    from meshtron.train import host_copy
    live = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh(dp=2)["dp"], [Shard(0)], run_check=False)
    host = host_copy.allocate({"w": live, "step": torch.tensor(3.0, device="meta"), "n": 5,
                               "moments": [torch.empty(2, 0, device="meta")]}, pin=False)
    w = host["w"]
    return (type(w).__name__, w._spec == live._spec, w.to_local().device.type, w.to_local().is_shared(),
            tuple(w.to_local().shape), host["step"].shape, host["step"].is_shared(), host["n"],
            tuple(host["moments"][0].shape), host["moments"][0].is_shared())


def test_the_host_copy_is_made_without_reading_the_state(pools):
    # so that it can be made beside the steps; torch's helper copies each DTensor to the host first
    for got in pools.run(2, _host_copy_of_meta_state):
        assert got == ("DTensor", True, "cpu", True, (4, 3), torch.Size([]), True, 5, (2, 0), True), got


def _short_of_shared_memory(rank, world):
    """Rank 1's /dev/shm too small for the host copy: what each rank's first save check raises."""
    import meshtron.train.async_checkpoint as ac

    saver = ac.BackgroundSaver(timeout_s=60)
    real = ac.os.statvfs

    def small(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 1, 1) + tuple(st)[5:])   # 4 KiB free
    if rank == 1:
        ac.os.statvfs = small
    try:
        saver._check_shared_memory({"w": torch.ones(1 << 16)})
        raised = None
    except ValueError as e:
        raised = (type(e).__name__, str(e), getattr(e, "all_ranks", False))
    finally:
        ac.os.statvfs = real
        saver.close()
    return raised


def test_a_host_copy_that_dev_shm_cannot_hold_is_refused_on_every_rank(pools):
    # a tmpfs written past its size ends the process by SIGBUS, without a word
    for rank, raised in enumerate(pools.run(2, _short_of_shared_memory, timeout=300)):
        assert raised is not None and raised[0] == "CheckpointError" and raised[2], raised
        assert "/dev/shm" in raised[1] and "--shm-size" in raised[1], raised
        assert ("this rank's node" if rank == 1 else "another rank's node") in raised[1], raised


def _slow_writes(rank, world, argv):
    """Train with the background writes slowed down and watched: the write of step N
    waits until the loop has finished step N + 1 (where the run goes that far: the loop
    provably went on, and changed the weights and AdamW state in place), and records
    what it saw. Returns (the losses, the writes, what rank 0 printed)."""
    import meshtron.train.async_checkpoint as ac
    from meshtron import Config, Trainer, models
    from meshtron.train.lifetime import DirectoryLock, DirectoryLocked

    config = Config.from_args(argv, models=models.PRESETS)
    root = config.checkpoint.checkpoint_dir
    started, writes, real = {}, [], ac.BackgroundSaver._write_shards

    def on_step(step):
        started.setdefault(step, threading.Event()).set()

    def slow_write(saver, staged, path):   # the saver's thread, before it hands the copy to the writer
        step = int(path[-8:])
        seen = {"step": step, "start": time.monotonic(),
                "complete": [os.path.basename(p) for p in checkpoint.list_checkpoints(root)]}
        if step + 2 <= config.training.steps:   # on_step(N + 2): step N + 1 has run
            seen["loop_went_on"] = started.setdefault(step + 2, threading.Event()).wait(timeout=60)
        if rank == 0:
            try:
                DirectoryLock(root).acquire()
                seen["lock"] = "free"
            except DirectoryLocked:
                seen["lock"] = "held"
        time.sleep(0.2)
        real(saver, staged, path)
        seen["end"] = time.monotonic()
        writes.append(seen)

    printed = io.StringIO()
    ac.BackgroundSaver._write_shards = slow_write
    try:
        with contextlib.redirect_stdout(printed):
            losses = Trainer(config).train(on_step=on_step)
    finally:
        ac.BackgroundSaver._write_shards = real
    return losses, writes, printed.getvalue()


def test_saves_never_overlap_retention_spares_the_one_written_and_the_lock_waits(pools, tmp_path):
    ck = str(tmp_path / "ck")
    argv = COMMON + LAYOUTS["dp2-zero3"][1] + ["--checkpoint-dir", ck, "--checkpoint-interval", "2",
                                                "--keep-checkpoints", "1", *ASYNC]
    _, writes, printed = pools.run(2, _slow_writes, argv, timeout=300)[0]
    assert [w["step"] for w in writes] == [2, 4, 6]
    for before, after in zip(writes, writes[1:]):
        assert after["start"] >= before["end"]                    # one save in flight at a time
    # keep 1: while step N is written the previous one is still the newest complete checkpoint
    assert [w["complete"] for w in writes] == [[], ["step-00000002"], ["step-00000004"]]
    assert [w.get("loop_went_on") for w in writes] == [True, True, None]   # steps 3 and 5 trained meanwhile
    assert [w["lock"] for w in writes] == ["held"] * 3            # the last one too, written after the loop
    assert sorted(os.listdir(ck)) == [".lock", "step-00000006"]
    assert open(os.path.join(ck, ".lock")).read() == ""           # released, after the last write
    checkpoint.validate(os.path.join(ck, "step-00000006"))
    lines = printed.strip().splitlines()
    assert [line for line in lines if line.startswith("saved checkpoint")] == [
        f"saved checkpoint {ck}/step-0000000{s}" for s in (2, 4, 6)]
    assert lines[-2] == f"saved checkpoint {ck}/step-00000006"    # before the closing line, which says it waited
    assert f"; checkpoints in {ck} (waited " in lines[-1] and "s for the background save of step-00000006)" in lines[-1]
    assert sum(line.startswith(f"saving checkpoint {ck}/step-") and "in the background (the loop held " in line
               for line in lines) == 3


def _descendants(pid: int) -> list[int]:
    children = _children(pid)
    return children + [d for c in children for d in _descendants(c)]


def _name(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads worker pids from /proc")
@pytest.mark.slow
def test_a_job_killed_while_a_save_is_written_resumes_from_the_previous_one_exactly(pools, tmp_path):
    # the write of step 6 is held (MESHTRON_HOLD_SAVE_AT_STEP) once every rank's shards are on disk,
    # before the rename; the loop trains on to step 9, whose save waits for it; then the job is killed
    ck, metrics, log = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "agent.log"
    args = TINY + DP2 + ["--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-interval", "3",
                         "--keep-checkpoints", "1", "--metrics-file", str(metrics), "--pg-timeout", "30", *ASYNC]
    steps = lambda: {json.loads(line)["step"] for line in metrics.read_text().splitlines()}  # noqa: E731
    with open(log, "w") as out:
        agent = subprocess.Popen(TORCHRUN + args, env=_env() | {"MESHTRON_HOLD_SAVE_AT_STEP": "6"}, stdout=out,
                                 stderr=subprocess.STDOUT)
    try:
        _wait_for_line(log, "holding the save of step 6", agent)
        _wait_for(lambda: 9 in steps(), "step 9 trained while step 6 was written", proc=agent)
        tmp = ck / ".tmp-step-00000006"
        shards = sorted(os.listdir(tmp))
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards   # written, not yet renamed
        assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(ck))] == ["step-00000003"]
        with pytest.raises(checkpoint.CheckpointError, match="not a complete meshtron checkpoint"):
            checkpoint.validate(str(tmp))
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        writers = [p for w in workers for p in _descendants(w) if _name(p) == "meshtron-writer"]
        assert len(writers) == 2, writers
        _kill_agent(agent, workers)
        _wait_for(lambda: not any(map(_alive, writers)), "the writer processes end with their job",
                  timeout=30)
    finally:
        agent.kill()
    assert checkpoint.latest_good(str(ck)) == (str(ck / "step-00000003"), [])
    out = subprocess.run(FORKED + args + ["--resume", "auto"], env=_env() | {"MESHTRON_EXIT_AFTER": "6"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from {ck}/step-00000003 at step 3" in out.stdout
    assert f"removed .tmp-step-00000006 from {ck}: left by a killed save" in out.stdout
    assert sorted(os.listdir(ck)) == [".lock", "step-00000009"]      # keep 1, once 6 and 9 were written
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {r["step"] for r in rows} == set(range(1, 10))
    straight = pools.run(2, train, TINY + DP2 + ["--steps", "100000"], 9, timeout=300)[0]
    # the killed job's steps 4-9 (trained past the save in flight) and the resumed job's alike
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], straight[r["step"] - 1]) for r in rows]
    assert sum(r["step"] == 6 for r in rows) == 2                   # trained by both jobs


def _checksums_past_the_deadline(rank, world, argv):
    """Train to step 5 with async saves every 2 steps, where step 4's save gets a second
    and rank 0's checksum pass over its files waits until that save was given up (its writer
    stopped), then looks for 3 s whether the directory's lock was let go. Returns what the
    run raised here, what the checksum pass saw, and the checkpoints once no save thread is left."""
    import meshtron.train.checkpoint as ck
    from meshtron import Config, Trainer, models
    from meshtron.train.lifetime import DirectoryLock, DirectoryLocked

    config = Config.from_args(argv, models=models.PRESETS)
    root, seen, real = config.checkpoint.checkpoint_dir, {}, ck._crc32
    checksumming = threading.Event()

    def on_step(step):
        if step == 4:
            trainer.checkpoints.saver.timeout_s = 1.0
        if step == 5 and rank == 0:   # the loop reaches step 5's save, whose wait gives step 4's up
            seen["checksumming"] = checksumming.wait(timeout=60)

    def slow_crc(path):
        if ".tmp-step-00000004" in path and not checksumming.is_set():
            checksumming.set()
            seen["writer stopped"] = _poll(lambda: not _alive(trainer.checkpoints.saver.writer_pid), 60)
            seen["lock"] = "held"
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                lock = DirectoryLock(root)
                try:
                    lock.acquire()
                except DirectoryLocked:
                    time.sleep(0.05)
                    continue
                lock.release()
                seen["lock"] = "free"
                break
        return real(path)

    ck._crc32 = slow_crc
    trainer, raised = Trainer(config, verbose=False), None
    try:
        trainer.train(on_step=on_step)
    except checkpoint.CheckpointError as e:
        raised = str(e)
    finally:
        trainer.close()
        for thread in threading.enumerate():   # the old thread, had the save gone on without the run
            if thread.name.startswith("meshtron-save-"):
                thread.join(timeout=60)
        ck._crc32 = real
    return raised, seen, [os.path.basename(p) for p in checkpoint.list_checkpoints(root)]


def _poll(ok, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_save_given_up_during_rank_0s_checksums_is_never_published(pools, tmp_path):
    # issue 57, point 3: the give-up was checked once, before the checksums; the save was renamed into
    # place after wait() had said it was not, and the run let its directory go while the thread still ran
    ck = str(tmp_path / "ck")
    argv = COMMON + LAYOUTS["dp2-zero3"][1] + ["--steps", "5", "--checkpoint-dir", ck, "--checkpoint-interval", "2",
                                                *ASYNC]
    (raised0, seen, complete), (raised1, _, _) = pools.run(2, _checksums_past_the_deadline, argv, timeout=300)
    assert complete == ["step-00000002"], complete   # step 4 never renamed into place, not even after the error
    assert raised0 is not None and "\n" not in raised0, raised0
    assert "step-00000004 did not finish within 1 s" in raised0 and "the save was not published: the previous " \
           "complete checkpoint stays the newest" in raised0, raised0
    assert raised1 == "rank 0 did not publish the background save of step-00000004 (its error says why): the " \
                      "previous complete checkpoint stays the newest", raised1
    assert seen == {"checksumming": True, "writer stopped": True, "lock": "held"}, seen
    assert checkpoint.latest_good(ck) == (os.path.join(ck, "step-00000002"), [])
    assert open(os.path.join(ck, ".lock")).read() == ""   # released at the end, after the thread
