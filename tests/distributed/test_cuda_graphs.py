"""--cuda-graphs on the CPU: the graphs themselves need a GPU (the trainer refuses
them elsewhere, tests/test_errors.py), but what they need of FSDP does not. With
its gathered weights kept in place (cuda_graphs.keep_gathered, which apply_dp runs
under --cuda-graphs) training gives the same losses and weights as without, and
each all-gather writes into the same storage every step, where a graph recorded it."""
import pytest
import torch
from torch.distributed.tensor import DTensor

from meshtron.distributed.cuda_graphs import fsdp_params

TINY = ["--model", "tiny", "--untie-embeddings", "--seq-len", "32", "--global-batch", "8", "--warmup", "1",
        "--lr", "3e-3", "--log-interval", "100"]
LAYOUTS = {  # world, flags
    "dp2 x tp2 zero1": (4, ["--dp", "2", "--tp", "2", "--sp", "--zero", "1", "--micro-batch", "2"]),
    "dp2 x pp2 zero1": (4, ["--dp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2", "--micro-batch", "2"]),
}
STEPS = 3


def _gathered(parts) -> list[tuple[int, int]]:
    """(address, bytes) of the storage of every gathered weight FSDP holds for this rank."""
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().size())
            for part in parts for p in fsdp_params(part) for t in p.all_gather_outputs]


def _train(rank, world, argv, keep):
    from meshtron import Config, Trainer, models
    from meshtron.distributed.cuda_graphs import keep_gathered
    trainer = Trainer(Config.from_args(argv + ["--steps", str(STEPS)], models=models.PRESETS), verbose=False)
    try:
        if keep:   # what apply_dp does under --cuda-graphs, which the trainer refuses on CPUs
            for part in trainer.parts:
                keep_gathered(part)
        losses, storages = [], []
        for _ in range(STEPS):
            loss, _ = trainer.step(*trainer.next_batch())
            losses.append(float(loss))
            storages.append(_gathered(trainer.parts))
        weights = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                   for part in trainer.parts for n, p in part.named_parameters()}
        return losses, storages, weights
    finally:
        trainer.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.fast_cases("dp2 x pp2 zero1")
def test_kept_weights_train_the_same_in_the_same_storage(pools, layout):
    world, flags = LAYOUTS[layout]
    freed = pools.run(world, _train, TINY + flags, False)
    kept = pools.run(world, _train, TINY + flags, True)
    for (losses, storages, weights), (ref_losses, ref_storages, ref_weights) in zip(kept, freed):
        assert losses == ref_losses   # the same computation, bit for bit: only where the gathered weights live
        assert weights.keys() == ref_weights.keys()
        for n, w in weights.items():
            assert torch.equal(w, ref_weights[n]), n
        # without: every gathered weight is freed after its step's backward
        assert all(size == 0 for step in ref_storages for _, size in step)
        # kept: allocated, and at the same address every step
        assert storages[0] and all(size > 0 for _, size in storages[0])
        assert storages[1:] == storages[:-1]


def _apply_dp_keeps(rank, world):
    from meshtron.config import ParallelConfig
    from meshtron.distributed.parallelize import apply_dp

    from harness import mesh
    out = []
    for graphs in (False, True):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        apply_dp(model, mesh(dp=2), ParallelConfig(dp=2, cuda_graphs=graphs), list(model))
        out.append([p.__dict__.get("free_unsharded_param") is not None for p in fsdp_params(model)])
    return out


def test_apply_dp_keeps_gathered_weights_only_under_cuda_graphs(pools):
    for plain, graphs in pools.run(2, _apply_dp_keeps):
        assert plain and not any(plain)
        assert graphs and all(graphs)
