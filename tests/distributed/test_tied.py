"""Tied weights stay one weight through every step that replaces parameters
(meta -> device, tensor parallelism, FSDP, pipeline stages, checkpoint and
safetensors loading), and a plan that would split them two ways is refused."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron import Config, Trainer, parallelize_module
from meshtron.distributed.tied import materialize, tied_groups

from harness import mesh
from parity import tiny_batches

VOCAB, DIM = 96, 32


class TiedLM(nn.Module):
    """A user's model with `head.weight = emb.weight`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x))))


def test_materialize_keeps_ties():
    with torch.device("meta"):
        model = TiedLM()
    materialize(model, "cpu")
    assert model.head.weight is model.emb.weight and model.head.weight.device.type == "cpu"
    with torch.device("meta"):
        plain = TiedLM()
    plain.to_empty(device="cpu")    # what it guards against
    assert plain.head.weight is not plain.emb.weight


def _user_tied(rank, world, plan):
    m = mesh(dp=1, tp=world)
    ref, par = TiedLM(), TiedLM()
    n_before = sum(1 for _ in par.parameters())
    parallelize_module(par, m, plan)
    n_after = sum(1 for _ in par.parameters())
    opts = [torch.optim.SGD(mod.parameters(), lr=0.5) for mod in (ref, par)]
    emb_err = None
    for step, (x, y) in enumerate(tiny_batches(VOCAB, 6, 4, 8)):
        for mod in (ref, par):
            F.cross_entropy(mod(x).flatten(0, 1), y.flatten()).backward()
        if step == 0:
            g, r = par.emb.weight.grad.full_tensor(), ref.emb.weight.grad
            emb_err = float((g - r).abs().max() / r.abs().max())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    x, _ = tiny_batches(VOCAB, 1, 2, 8, seed=1)[0]
    out = par(x)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    ref_out = ref(x)
    logits_err = float((out - ref_out).abs().max() / ref_out.abs().max())   # fp32 noise after 6 steps of lr 0.5
    return n_before, n_after, par.head.weight is par.emb.weight, emb_err, logits_err


def test_parallelize_module_keeps_a_users_tied_weights(pools):
    # the plan of issue 11: vocab-parallel embedding, gathered column-parallel head (both Shard(0))
    plan = {"emb": "vocab_parallel", "mix": "replicate", "head": "colwise_rep"}
    for n_before, n_after, tied, emb_err, logits_err in pools.run(2, _user_tied, plan):
        assert n_after == n_before and tied
        assert emb_err < 1e-6 and logits_err < 1e-5, (emb_err, logits_err)


def _conflict(rank, world):
    try:
        parallelize_module(TiedLM(), mesh(dp=1, tp=world), {"emb": "vocab_parallel"})   # head left Replicate
    except ValueError as e:
        return str(e)


def test_a_plan_that_splits_tied_weights_two_ways_is_refused(pools):
    for msg in pools.run(2, _conflict):
        assert "tied parameters would be split differently" in msg and "emb.weight" in msg and "head.weight" in msg


LAYOUTS = {  # name: (world, flags); every way the trainer builds the GPT
    "one process fp32": (1, []),
    "one process bf16": (1, ["--dtype", "bf16"]),
    "dp2 zero3": (2, ["--dp", "2", "--zero", "3"]),
    "tp2 sp": (2, ["--tp", "2", "--sp"]),
    "pp2": (2, ["--pp", "2"]),
    "pp2 zbv": (2, ["--pp", "2", "--pp-schedule", "zbv", "--pp-virtual", "2", "--microbatches", "4"]),
}


def _tie_state(rank, world, flags):
    config = Config.from_args(["--seq-len", "16", "--micro-batch", "2"] + flags)
    trainer = Trainer(config, verbose=False)
    state = []
    for part in trainer.parts:
        emb, out = part.tok_embeddings, part.output
        state.append((emb is not None, out is not None, emb is not None and out is not None
                      and out.weight is emb.weight, [g for g in tied_groups(part)]))
    names = trainer._param_names() or {}
    return state, sorted(set(names.values()) & {"tok_embeddings.weight", "output.weight"})


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_build_path_keeps_the_gpt_tied(pools, name):
    world, flags = LAYOUTS[name]
    for state, names in pools.run(world, _tie_state, flags):
        for has_emb, has_out, tied, groups in state:
            if has_emb and has_out:
                assert tied and groups == [["tok_embeddings.weight", "output.weight"]], state
        if name.startswith("pp"):   # a stage's copy of the head is stored under the embedding's name
            assert names in ([], ["tok_embeddings.weight"]), names
