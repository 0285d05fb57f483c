"""A run's checkpoints, in one place (torchtitan's CheckpointManager): what it resumes, and
its saves, blocking or in the background.

Before anything communicates, among the Trainer's checks: `find_resume` reads which
checkpoint the run continues and whether it was saved under other learning-rate schedule
settings, then `hold_directory` locks --checkpoint-dir (rank 0) and clears what killed saves
left, in that order, so a directory of another model's checkpoints is refused with its files
untouched.

Once the model, optimizer, schedule and data loader exist, the Trainer builds one
`CheckpointManager` and calls it the same way under either kind of save: `resume` loads the
checkpoint into them, `prepare` after the first step, `maybe_save(step)` at each step's end,
`finish` before the closing line and `close` at the end. A blocking save writes with every
rank (checkpoint.save); with --checkpoint-async a save holds the loop only while the state
is copied to host memory, and a writer process of each rank writes it
(async_checkpoint.BackgroundSaver), one save in flight at a time. Once `close` returns no
thread of the run touches the directory: the Trainer releases its lock after it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from meshtron.config import Config, ConfigError
from meshtron.train import checkpoint
from meshtron.train.async_checkpoint import BackgroundSaver
from meshtron.train.lifetime import DirectoryLock, describe
from meshtron.train.optim import plan_again

# the settings a checkpoint's learning-rate schedule and AdamW groups were made with (TrainingConfig's)
SCHEDULE = ("steps", "warmup", "lr", "min_lr_ratio", "weight_decay")


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues (None: it starts at step 0), its schedule settings that
    differ from this run's ({field: (there, here)}), and the schedule it was planned again to
    (by --schedule-override), if any."""
    path: str | None = None
    changes: dict = field(default_factory=dict)
    plan: dict | None = None


def find_resume(config: Config, model_config, name: str, log) -> Resume:
    """What the run resumes: with --resume auto the newest sound checkpoint of --checkpoint-dir,
    with a path that one, checked; without --resume a directory that holds checkpoints already
    is refused. `name`: what the user called the model, for a checkpoint of another one."""
    ck = config.checkpoint
    if ck.resume == "auto":
        path, skipped = checkpoint.latest_good(ck.checkpoint_dir, model_config, name)
        for reason in skipped:
            log(f"skipping a bad checkpoint: {reason}")
        if path is None:
            log(f"--resume auto: no checkpoint to resume in {ck.checkpoint_dir}; starting from step 0")
            return Resume()
        return _under_its_schedule(path, config)
    if ck.resume != "none":
        checkpoint.validate(ck.resume, model_config, name=name)
        return _under_its_schedule(ck.resume, config)
    if ck.checkpoint_dir and checkpoint.list_checkpoints(ck.checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {ck.checkpoint_dir} already holds checkpoints (newest "
                          f"{os.path.basename(checkpoint.latest(ck.checkpoint_dir))}): pass --resume auto to "
                          "continue from them, or another directory")
    return Resume()


def _under_its_schedule(path: str, config: Config) -> Resume:
    """`path` with the schedule settings it was saved under that differ from this run's. A difference
    is refused without --schedule-override (Megatron's --override-opt_param-scheduler): the loaded
    schedule would follow the new settings from the resumed step on, and the learning rate jump there
    without a word."""
    meta = checkpoint.record_of(path)
    layout = (meta or {}).get("layout")
    saved = layout.get("training") if isinstance(layout, dict) else None
    if not isinstance(saved, dict):   # a checkpoint saved outside the Trainer records no settings
        return Resume(path)
    tr = config.training
    changes = {k: (saved[k], getattr(tr, k)) for k in SCHEDULE if k in saved and saved[k] != getattr(tr, k)}
    if changes and not config.checkpoint.schedule_override:
        said = "; ".join(f"--{k.replace('_', '-')} {a} there, {b} here" for k, (a, b) in changes.items())
        raise ConfigError(f"checkpoint {path} was saved under another learning-rate schedule "
                          f"({said}): pass --schedule-override to plan it again from step {meta.get('step')} "
                          "(the learning rate goes on from its value there to the new end), or resume with "
                          "the checkpoint's values")
    return Resume(path, changes, meta.get("schedule"))


def hold_directory(directory: str | None, log) -> DirectoryLock | None:
    """Rank 0: lock --checkpoint-dir for the run (inside agree(): a live holder stops every rank
    before anything communicates), then clear what killed saves left."""
    if not directory:
        return None
    lock = DirectoryLock(directory)
    dead = lock.acquire()
    if dead:
        log(f"took over {directory}: its lock was left by a run that died holding it, {describe(dead)}")
    for left in checkpoint.clear_unfinished(directory):
        log(f"removed {left} from {directory}: left by a killed save")
    return lock


class CheckpointManager:
    """The run's saves and its resume. Made on every rank at the same point of the set-up: with
    --checkpoint-async it makes the saver's process group and writer process. `names`: the
    parameters' names (a pipeline's, else None); `record`: what meshtron.json says the
    checkpoints are (checkpoint.save's config, model, preset, tokenizer); `progress`: the
    loop's, told the newest checkpoint's step (what a restart would lose) and when it saves."""

    def __init__(self, config: Config, resume: Resume, parts, optimizer, scheduler, loader, *,
                 names: dict[int, str] | None, record: dict, progress, log):
        self.config, self.resume_from = config, resume
        self.parts, self.optimizer, self.scheduler, self.loader = parts, optimizer, scheduler, loader
        self.names, self.record, self.progress, self.log = names, record, progress, log
        self.schedule = resume.plan   # a schedule planned again at a resume, recorded with each save
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        ck = config.checkpoint
        self.saver = BackgroundSaver(config.training.pg_timeout) if ck.checkpoint_async and ck.checkpoint_dir \
            else None

    def resume(self) -> int:
        """Load the checkpoint the run resumes into its state; the step it starts from (0
        without one). Under --schedule-override the schedule goes on planned again from there;
        checkpoints newer than it are set aside."""
        path, ck = self.resume_from.path, self.config.checkpoint
        if path is None:
            return 0
        start = checkpoint.load(path, self.parts, self.optimizer, self.scheduler, self.loader,
                                config=self.record["config"], rebatch_by_tokens=ck.data_rebatch, names=self.names)
        self.log(f"resumed from {path} at step {start}")
        self.progress.saved = start
        self._plan_schedule(start)
        if ck.checkpoint_dir and self.rank == 0:
            for moved in checkpoint.set_aside_newer(ck.checkpoint_dir, start):
                self.log(f"set aside a checkpoint newer than step {start}: {moved}")
        return start

    def _plan_schedule(self, start: int) -> None:
        """Under --schedule-override with settings that changed, plan the schedule again from `start`, from
        the learning rate the checkpoint left (a warmup under way goes on to the new --warmup, one over
        stays over), and say so; a schedule planned so before (recorded in the checkpoint) goes on."""
        tr, plan, changes = self.config.training, self.schedule, self.resume_from.changes
        if changes:
            warmup_end = plan["warmup_to"] if plan else changes.get("warmup", (tr.warmup,))[0]
            lr = self.optimizer.param_groups[0]["lr"]
            plan = {"from_step": start, "from_lr": lr,
                    "warmup_to": tr.warmup if start < min(warmup_end, tr.warmup) else start}
            said = ", ".join(f"--{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in changes.items())
            warm = f", warmup to {tr.lr:.2e} at step {tr.warmup}" if plan["warmup_to"] > start else ""
            self.log(f"--schedule-override ({said}): the learning-rate schedule planned again from step {start}: "
                     f"{lr:.2e} there{warm}, cosine down to {tr.lr * tr.min_lr_ratio:.2e} at step {tr.steps}")
        if plan is not None:
            plan_again(self.optimizer, self.scheduler, plan, tr.lr, tr.steps, tr.min_lr_ratio, tr.weight_decay)
        self.schedule = plan

    def prepare(self) -> None:
        """With --checkpoint-async, have the host copy that saves write from made beside the
        next steps (BackgroundSaver.prepare); call on every rank once a step has run."""
        if self.saver is not None:
            self.saver.prepare(self.parts, self.optimizer, self.scheduler, self.loader, self.names)

    def due(self, step: int) -> bool:
        """Whether the run saves after `step`: every --checkpoint-interval steps and after the last."""
        ck = self.config.checkpoint
        return bool(ck.checkpoint_dir) and (step % ck.checkpoint_interval == 0 or step == self.config.training.steps)

    def maybe_save(self, step: int) -> None:
        """Save after `step` where one is due; else say which background save has finished since."""
        if self.due(step):
            self.progress.at("checkpoint")
            self.save(step)
        elif self.saver is not None:
            self._saved(self.saver.poll())

    def save(self, step: int) -> float:
        """Save the state after `step` into --checkpoint-dir; returns the seconds the loop was
        held. With --checkpoint-async it is copied to host memory and written in the
        background, after the previous save has finished."""
        ck, t0 = self.config.checkpoint, time.perf_counter()
        args = (ck.checkpoint_dir, step, self.parts, self.optimizer, self.scheduler, self.loader)
        kw = dict(layout=self.config, keep=ck.keep_checkpoints, names=self.names, schedule=self.schedule,
                  **self.record)
        if self.saver is None:
            self._saved(checkpoint.save(*args, **kw))
            return time.perf_counter() - t0
        self.wait()
        path = self.saver.save(*args, **kw)
        held = time.perf_counter() - t0
        self.log(f"saving checkpoint {path} in the background (the loop held {held:.2f} s)")
        return held

    @property
    def in_flight(self) -> str | None:
        """The path of the background save being written, or None."""
        return self.saver.in_flight if self.saver is not None else None

    def wait(self) -> str | None:
        """Wait for the background save in flight; its path, now in place (None where none was
        waiting). A save that failed or was given up raises here."""
        return self._saved(self.saver.wait()) if self.saver is not None else None

    def finish(self) -> str:
        """Wait for the last background save; what the run's closing line says of it ("" without
        --checkpoint-async)."""
        if self.saver is None or not self.saver.started:
            return ""
        writing, t0 = self.saver.in_flight, time.perf_counter()
        self.wait()
        if writing is None:
            return " (every background save had finished)"
        return f" (waited {time.perf_counter() - t0:.1f} s for the background save of {os.path.basename(writing)})"

    def close(self) -> None:
        """Wait for a background save and stop the writer process: once it returns, no thread of
        the run touches the directory. A save's failure is said, not raised (the run is closing
        after another error, or `finish` raised it already); safe to repeat."""
        if self.saver is None:
            return
        writing = self.saver.in_flight
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - closing after another error: say it, let the directory go
            self.log(f"the background save of {writing} failed: {e}")
        finally:
            self.saver.close()

    def _saved(self, path: str | None) -> str | None:
        if path is not None:
            self.progress.saved = checkpoint.step_of(path)
            self.log(f"saved checkpoint {path}")
        return path
