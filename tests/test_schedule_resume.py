"""A resume under other schedule settings than the checkpoint's (issue 57, point 2): refused in one
line naming each flag that differs; with --schedule-override the schedule is planned again from the
resumed step, going on from the learning rate there (a warmup over stays over) to the new end, and a
later resume of that run goes on along the same plan; an unchanged resume is untouched."""
import contextlib
import io
import shutil

import pytest

from meshtron.train import checkpoint

ARGV = ["--model", "tiny", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "4", "--log-interval", "100",
        "--warmup", "2", "--lr", "1e-3", "--min-lr-ratio", "0.1", "--checkpoint-interval", "3"]


def _lrs(rank, world, argv, exit_after=None):
    """Train; the learning rate each step ran with, the one the schedule left after the last, the
    losses and what rank 0 printed; or the one-line error that stopped it."""
    from meshtron import Config, Trainer, models
    from meshtron.config import ConfigError
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            trainer = Trainer(Config.from_args(argv, models=models.PRESETS))
            used = {}
            losses = trainer.train(exit_after, on_step=lambda s: used.setdefault(
                s, trainer.optimizer.param_groups[0]["lr"]))
    except ConfigError as e:
        return str(e)
    return used, trainer.scheduler.get_last_lr()[0], losses, out.getvalue()


def test_a_resume_under_other_schedule_settings_is_refused_or_planned_again(pools, tmp_path):
    ck, straight = str(tmp_path / "ck"), ARGV + ["--steps", "10"]
    full_lrs, _, full_losses, _ = pools.run(1, _lrs, straight)[0]
    first_lrs, left, _, _ = pools.run(1, _lrs, straight + ["--checkpoint-dir", ck], 6)[0]   # saves 3 and 6
    shutil.copytree(ck, tmp_path / "saved")

    longer = ["--checkpoint-dir", ck, "--resume", "auto", "--steps", "14", "--warmup", "8"]
    refused = pools.run(1, _lrs, ARGV + longer)[0]
    assert isinstance(refused, str) and "\n" not in refused, refused
    assert f"checkpoint {ck}/step-00000006 was saved under another learning-rate schedule (--steps 10 there, " \
           "14 here; --warmup 2 there, 8 here): pass --schedule-override" in refused, refused
    assert [c[-8:] for c in checkpoint.list_checkpoints(ck)] == ["00000003", "00000006"]

    lrs, end, _, printed = pools.run(1, _lrs, ARGV + longer + ["--schedule-override"])[0]
    assert sorted(lrs) == list(range(7, 15))
    assert lrs[7] == left                        # the step after the save runs with the rate the save left
    assert all(lrs[s + 1] < lrs[s] for s in range(7, 14)), lrs   # the warmup, over at step 2, stays over
    assert end == pytest.approx(1e-4)            # the new end: --lr x --min-lr-ratio after step 14
    assert sum("the learning-rate schedule planned again from step 6" in line
               for line in printed.splitlines()) == 1, printed

    # the planned schedule is recorded with each save: a resume with the new settings goes on along it
    again = str(tmp_path / "again")
    shutil.copytree(tmp_path / "saved", again)
    argv = ARGV + ["--checkpoint-dir", again, "--resume", "auto", "--steps", "14", "--warmup", "8"]
    part, _, _, _ = pools.run(1, _lrs, argv + ["--schedule-override"], 3)[0]   # steps 7-9, saved at 9
    rest, rest_end, _, _ = pools.run(1, _lrs, argv)[0]
    assert part | rest == lrs and rest_end == end

    # unchanged settings resume as before: the straight run's rates and losses
    same_lrs, _, same_losses, printed = pools.run(1, _lrs, straight + ["--checkpoint-dir", str(tmp_path / "saved"),
                                                                         "--resume", "auto"])[0]
    assert first_lrs | same_lrs == full_lrs and same_losses == full_losses[6:]
    assert "planned again" not in printed
