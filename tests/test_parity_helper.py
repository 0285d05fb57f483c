"""The parity helper itself: it passes a correct layout and catches wrong ones."""
import pytest

from meshtron import ParallelConfig
from meshtron.models import GPT, gpt_config
from meshtron.models.gpt import parallelize_gpt
from meshtron.train.loss import cross_entropy_sum

from harness import mesh
from parity import assert_parity, run_parity, tiny_batches

CFG = gpt_config("tiny", n_layers=2)


def build():
    return GPT(CFG, seed=0)


def zero3(model, me):
    parallelize_gpt(model, me, ParallelConfig(zero=3))
    return model


def _correct(rank, world):
    return run_parity(mesh(dp=world), build, zero3, tiny_batches(CFG.vocab_size, steps=3, batch=4, seq=16))


def _no_grad_reduction(rank, world):
    # each rank trains on its half of the batch and never reduces gradients
    return run_parity(mesh(dp=world), build, lambda m, me: m, tiny_batches(CFG.vocab_size, steps=3, batch=4, seq=16))


def _micro_batches_summed(rank, world):
    # gradient accumulation that counts each micro-batch's tokens as the whole batch
    return run_parity(mesh(dp=world), build, zero3, tiny_batches(CFG.vocab_size, steps=3, batch=8, seq=16),
                      micro_batches=2, fb_kwargs={"loss_fn": lambda lg, y: 2 * cross_entropy_sum(lg, y)})


def test_parity_helper_passes_a_correct_layout(pools):
    worst = assert_parity(pools.run(2, _correct), tol=1e-5)
    assert worst.worst < 1e-5 and len(worst.losses) == 3


@pytest.mark.parametrize("check", [_no_grad_reduction, _micro_batches_summed])
def test_parity_helper_catches_a_wrong_layout(pools, check):
    reports = pools.run(2, check)
    with pytest.raises(AssertionError, match="parity failed"):
        assert_parity(reports, tol=1e-5)
    assert max(r.grad for r in reports) > 1e-2
