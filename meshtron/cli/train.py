"""The training command line: recipes/train.py's entry point.

    python recipes/train.py --model tiny --steps 20                     # a world of one
    torchrun --nproc-per-node 4 recipes/train.py --dp 2 --tp 2 --steps 50

`run` parses and checks the flags (meshtron.config) before anything imports
torch, which takes seconds on every rank, so a mistake in them shows at once;
then it starts the process group, trains (meshtron/train/trainer.py) and reports
any problem of the user's as one line (lifetime.one_line_errors). `--dry-run`
hands the config to the planner instead; `--layout auto` asks the planner for
the layout first, and tries its best few on every rank (meshtron.cli.layout_auto).
Before the closing line, rank 0 compares the run's training steps with the
planner's prediction for its layout (meshtron.cli.comparison).

Test hooks (environment, not flags): MESHTRON_EXIT_AFTER=N stops after N steps
of this run (the schedule still spans --steps); MESHTRON_CRASH_AT_STEP=N kills
rank 1 at step N on a torchrun job's first attempt (fault-recovery tests);
MESHTRON_SLOW_RANK and MESHTRON_HANG make a straggler and a hang (meshtron.cli.faults);
MESHTRON_FREE_MEMORY_GIB and MESHTRON_TRIAL_FAIL stand in for the free memory --layout auto
reads and fail one of its trials (meshtron.cli.layout_auto, meshtron.cli.trials);
MESHTRON_HOLD_SAVE_AT_STEP holds a background save (meshtron/train/async_checkpoint.py).
"""
from __future__ import annotations

import os
import sys

from meshtron.cli import faults
from meshtron.command_line import LAYOUT_TRIALS
from meshtron.config import Config, ConfigError
from meshtron.models import presets
from meshtron.train.lifetime import elastic_hint, init_process_group, one_line_errors


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return int(value)


def _crash_hook(rank: int):
    """MESHTRON_CRASH_AT_STEP: rank 1 lost mid-run, once; torchrun --max-restarts restarts the job."""
    at = _env_int("MESHTRON_CRASH_AT_STEP")
    if at is None or rank != 1 or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None

    def hook(step: int) -> None:
        if step == at:
            os._exit(13)
    return hook


def main(argv=None, *, description: str | None = None, exit_after: int | None = None) -> list[float]:
    """Parse, check, build, train; returns the losses. Used by recipes/train.py and tests."""
    config, args = Config.parse(argv, description, presets.TRAINING)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.layout_trials is not None and args.layout != "auto":
        raise ConfigError("--layout-trials tries --layout auto's candidates: it needs --layout auto")
    if args.layout_trials is not None and args.layout_trials < 0:
        raise ConfigError(f"--layout-trials must be at least 0, not {args.layout_trials}")
    if args.layout == "auto" and args.dry_run is not None:   # the planner's choice and its command; nothing runs
        from meshtron.cli import layout_auto
        world = args.dry_run or _env_int("WORLD_SIZE") or 1
        lines = layout_auto.dry_run_lines(config, argv, world, _env_int("LOCAL_WORLD_SIZE") or world, presets.TRAINING)
        if os.environ.get("RANK", "0") == "0":
            print("\n".join(lines), flush=True)
        return []
    if args.dry_run == 0:
        raise ConfigError("--dry-run needs N, the world size to build (or --layout auto)")
    if args.dry_run is not None:
        from meshtron.planner.dry_run import dry_run  # the planner and the fake process group, only when asked
        ranks = None if args.dry_run_ranks is None else [int(r) for r in args.dry_run_ranks.split(",")]
        dry_run(config, args.dry_run, ranks)
        return []
    world = _env_int("WORLD_SIZE")
    if world is not None:   # the launcher's (or one_line_errors' world of one); the Trainer checks again
        try:
            config.validate(world)
        except ConfigError as e:
            raise ConfigError(f"{e}{elastic_hint(str(e), args.layout)}") from None
    # torch only now, with the flags checked: its import takes seconds on every rank
    import torch.distributed as dist

    from meshtron.cli import comparison
    from meshtron.train.trainer import Trainer

    created = not dist.is_initialized()
    init_process_group(config.training.pg_timeout)
    try:
        if args.layout == "auto":   # the planner's layout, tried here first: every rank runs the trials
            from meshtron.cli import layout_auto
            trials = LAYOUT_TRIALS if args.layout_trials is None else args.layout_trials
            config, _ = layout_auto.auto(config, argv, trials, presets.TRAINING)
        if exit_after is None:
            exit_after = _env_int("MESHTRON_EXIT_AFTER")
        trainer = Trainer(config)
        rank = dist.get_rank()

        def compare() -> None:   # beside the closing line: each run checks the planner's cost model
            if trainer.step_s and rank == 0:
                trainer.log(comparison.line(trainer.config, dist.get_world_size(), trainer.microbatches,
                                            trainer.step_s, trainer.device))
        try:
            losses = trainer.train(exit_after=exit_after,
                                   on_step=faults.on_step(_crash_hook(rank), faults.slow(rank), faults.hang(rank)),
                                   on_end=compare)
        except Exception as e:
            if trainer.watchdog is not None:   # a peer gone: one line and exit; else the error as it came
                trainer.watchdog.lost_peer(e)
            raise
        finally:
            trainer.close()
    except BaseException as e:
        # every rank stopped at the same check: no teardown can wait on a lost peer
        if created and getattr(e, "all_ranks", False):
            dist.destroy_process_group()
        raise
    if created:   # a caller (a test) may start another world in this process
        dist.destroy_process_group()
    return losses


def run(argv=None, description: str | None = None) -> None:
    """The recipe's entry point: a world of one without torchrun (no port: see
    init_process_group); a problem is one line on stderr (lifetime.one_line_errors)."""
    one_line_errors(main, argv, description=description)
