"""Packed documents (issue 37): with a document mask, per-document positions and no
loss across a document's end, a packed batch trains exactly as its documents run
one by one, unpacked and unpadded: the same loss and every gradient, in fp32, at
one process and under dp2, tp2 + SP, pp2, cp2 (Ulysses) and ep2 (MoE); the
boundaries come from the data (end-of-text ids, or a Megatron dataset's .idx)."""
import contextlib
import dataclasses
import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtron import ParallelConfig, models
from meshtron.config import Config, ConfigError
from meshtron.data import BatchLoader, IndexedDatasetWriter, Tokens
from meshtron.data.sources import document_starts, open_data
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.distributed.mesh import batch_slice
from meshtron.models import GPT, gpt_config
from meshtron.models.common.documents import block_mask, dense_mask, document_inputs, kept_pairs, positions_in_documents
from meshtron.models.common.moe import MoEConfig
from meshtron.models.gpt import SPEC as GPT_SPEC
from meshtron.models.llama import SPEC as LLAMA_SPEC
from meshtron.models.llama import Llama, LlamaConfig
from meshtron.train.layout import resolve_layout
from meshtron.train.loss import IGNORE_INDEX
from meshtron.train.step import forward_backward

from harness import mesh, train
from parity import full, layout, pipelined, rel_err

TOL = 1e-6
SEQ, BATCH = 32, 4
EOT = ByteTokenizer.eot
LLAMA = LlamaConfig(n_layers=2, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=320, max_seq_len=64,
                    rope_theta=1e4)                                    # grouped-query: 2 query heads per KV head
GPT_CFG = gpt_config("tiny", n_layers=2, dim=64, n_heads=4, vocab_size=320, max_seq_len=64)   # learned positions
GPT_ROPE = dataclasses.replace(GPT_CFG, pos_emb="rope")   # what context parallelism takes per-document positions with
# routing per token (no aux loss or per-micro-batch balancing, which see the whole micro-batch)
MOE = dataclasses.replace(LLAMA, moe=MoEConfig(n_experts=4, top_k=2, hidden=32, aux_loss=0.0, bias_update=0.0))
MODELS = {"llama": (lambda: Llama(LLAMA, seed=0), LLAMA_SPEC, LLAMA),
          "gpt": (lambda: GPT(GPT_CFG, seed=0), GPT_SPEC, GPT_CFG),
          "gpt-rope": (lambda: GPT(GPT_ROPE, seed=0), GPT_SPEC, GPT_ROPE),
          "llama-moe": (lambda: Llama(MOE, seed=0), LLAMA_SPEC, MOE)}


def packed_stream(seed: int = 0, n_docs: int = 40) -> np.ndarray:
    """Documents of 1 to 24 random byte tokens, each ended by the end-of-text id."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(0, 256, rng.integers(1, 25)), EOT) for _ in range(n_docs)]
    return np.concatenate(docs).astype(np.uint16)


def packed_batch(seed: int = 0, mask: bool = True, positions: bool = True, eod_mask_loss: bool = True):
    """(x, y, the model's document inputs, the targets as read, the document of every
    token of the windows): a global batch of the packed stream."""
    stream = packed_stream(seed)
    loader = BatchLoader(Tokens(stream, document_starts(None, stream)), SEQ, BATCH, shuffle=False)
    x, read, documents = loader.next_batch()
    y, inputs = document_inputs(documents, read, mask=mask, positions=positions, eod_mask_loss=eod_mask_loss,
                                ignore_index=IGNORE_INDEX)
    return x, y, inputs, read, documents


def one_by_one(model, x, targets, documents):
    """The token-mean loss of every document fragment of the batch run on its own
    (plain causal attention, positions from 0), and its gradients. `targets` as read:
    a fragment's last token, whose target is the next document's first, has none here."""
    total, count = 0.0, 0
    for b in range(x.shape[0]):
        docs = documents[b, :-1]
        for d in docs.unique():
            idx = (docs == d).nonzero().squeeze(1)
            own = targets[b, idx].masked_fill(documents[b, idx + 1] != d, IGNORE_INDEX)
            logits = model(x[b:b + 1, idx])
            total = total + F.cross_entropy(logits[0].float(), own, ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((own != IGNORE_INDEX).sum())
    loss = total / count
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _under(model, degrees, pcfg_kwargs, x, y, inputs):
    """(loss, gathered gradients) of one step on the global batch, at one process or under the layout."""
    build, spec, cfg = MODELS[model]
    if not degrees:
        solo = build()
        loss = forward_backward([solo], x, y, None, inputs=inputs)
        parts = [solo]
    else:
        me = mesh(**degrees)
        pcfg = ParallelConfig(**degrees, **pcfg_kwargs)
        apply = pipelined(pcfg, spec, cfg) if degrees.get("pp", 1) > 1 else layout(pcfg, spec)
        par = apply(build(), me)
        pipe = par if not isinstance(par, torch.nn.Module) else None
        parts = pipe.parts if pipe else [par]
        index, count = batch_slice(me)
        local = {k: t.chunk(count)[index] for k, t in inputs.items()}
        loss = forward_backward(parts, x.chunk(count)[index], y.chunk(count)[index], me, zero=pcfg.zero,
                                pipeline=pipe, microbatches=1, inputs=local)
    return float(loss), {n: full(p.grad) for m in parts for n, p in m.named_parameters(remove_duplicate=False)
                         if p.grad is not None}


def _packed_vs_one_by_one(rank, world, model, degrees, pcfg_kwargs):
    x, y, inputs, read, documents = packed_batch()
    ref_loss, ref_grads = one_by_one(MODELS[model][0](), x, read, documents)
    loss, grads = _under(model, degrees, pcfg_kwargs, x, y, inputs)
    worst = max(rel_err(g, ref_grads[n].float()) for n, g in grads.items())
    return abs(loss - ref_loss) / ref_loss, worst, len(grads)


def _positions_alone(rank, world, model, degrees, pcfg_kwargs):
    """Per-document positions without the mask, where a rotary model sees them (under the mask
    it sees only the distance between two tokens of one document, which no offset changes):
    the layout against one process, and how far one process's gradients move without them."""
    x, y, inputs, _, _ = packed_batch(mask=False)
    assert set(inputs) == {"positions"}
    ref_loss, ref_grads = _under(model, {}, {}, x, y, inputs)
    loss, grads = _under(model, degrees, pcfg_kwargs, x, y, inputs)
    without = _under(model, {}, {}, x, y, {})[1]
    worst = max(rel_err(g, ref_grads[n].float()) for n, g in grads.items())
    return abs(loss - ref_loss) / ref_loss, worst, max(rel_err(g, ref_grads[n].float()) for n, g in without.items())


def test_positions_restart_and_the_mask_stays_in_each_document():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert positions_in_documents(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    m = dense_mask(documents, documents)[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False, False, False]
    assert m.sum() == 6 + 3 + 6


def _documents_of(rng, batch: int, seq: int, mean: float) -> torch.Tensor:
    """(batch, seq) document indices, lengths 1 + Exp(mean), in order as a loader gives them."""
    lengths = [1 + rng.exponential(mean, size=seq).astype(np.int64) for _ in range(batch)]
    return torch.from_numpy(np.stack([np.repeat(np.arange(seq), n)[:seq] for n in lengths]))


def test_the_block_mask_from_document_ranges_is_create_block_masks():
    # the GPU's BlockMask, built from each block's document range instead of every score entry: the same
    # blocks, full and partial, in the same order (the one-by-one tests below run the dense mask here)
    from torch.nn.attention.flex_attention import create_block_mask
    rng = np.random.default_rng(0)
    for seq, mean in ((256, 3.0), (512, 40.0), (1024, 300.0), (1024, 5000.0), (384, 90.0)):
        documents = _documents_of(rng, 2, seq, mean)
        ours = block_mask(documents)
        ref = create_block_mask(lambda b, h, q, k, d=documents: (d[b, q] == d[b, k]) & (q >= k), 2, None, seq, seq,
                                device="cpu")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (seq, mean, name)


def test_flex_attention_under_the_block_mask_is_the_dense_masks():
    # documents interleaved (no loader makes these): the block ranges overlap without sharing a document
    from torch.nn.attention.flex_attention import flex_attention
    g = torch.Generator().manual_seed(0)
    documents = torch.randint(0, 3, (2, 256), generator=g)
    q = torch.randn(2, 4, 256, 16, generator=g)
    k, v = (torch.randn(2, 2, 256, 16, generator=g) for _ in range(2))
    out = flex_attention(q, k, v, block_mask=block_mask(documents), enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=dense_mask(documents, documents))
    assert rel_err(out, ref) < 1e-6



def test_heads_narrower_than_flex_takes_or_dropout_use_the_dense_mask():
    # inductor's FlexAttention fails on GPUs below head dim 16 ("NYI: embedding dimension ... at least
    # 16"): llama-tiny (head dim 8) trained there only without --document-mask; the GPT's tiny has 16
    from meshtron import models
    with torch.device("meta"):
        dense = {name: models.get(name)[0].model_cls(models.get(name)[1], seed=None).document_mask.dense
                 for name in ("llama-tiny", "tiny", "llama-1B", "1.3B")}
    assert dense == {"llama-tiny": True, "tiny": False, "llama-1B": False, "1.3B": False}
    with torch.device("meta"):
        with_dropout = GPT(dataclasses.replace(gpt_config("1.3B"), dropout=0.1), seed=None)
    assert with_dropout.document_mask.dense    # FlexAttention has no dropout

@pytest.mark.parametrize("model", MODELS)
def test_packed_equals_one_by_one_on_one_process(pools, model):
    loss, grad, n = pools.run(1, _packed_vs_one_by_one, model, {}, {})[0]
    assert loss < TOL and grad < TOL and n > 0, (loss, grad)


LAYOUTS = {"dp2": (2, dict(dp=2), dict(zero=3)),
           "tp2 sp": (2, dict(dp=1, tp=2), dict(sp=True)),
           "pp2": (2, dict(dp=1, pp=2), {}),
           "cp2 a2a": (2, dict(dp=1, cp=2), dict(cp_comm="a2a")),
           "dp2 x tp2 sp": (4, dict(dp=2, tp=2), dict(sp=True, zero=3)),
           "dp2 full recompute": (2, dict(dp=2), dict(recompute="full")),
           "tp2 sp selective recompute": (2, dict(dp=1, tp=2), dict(sp=True, recompute="selective"))}


# the GPT where it differs from the Llama: learned positions sharded over the sequence under SP, a tied
# head across pipeline stages, rotary positions of its own under cp
GPT_LAYOUTS = ("tp2 sp", "pp2", "cp2 a2a")


@pytest.mark.parametrize("model,name", [("llama", n) for n in LAYOUTS] + [("gpt", n) for n in GPT_LAYOUTS])
@pytest.mark.fast_cases("llama-dp2", "llama-tp2 sp", "llama-pp2", "llama-cp2 a2a")
def test_packed_under_a_layout_equals_one_by_one(pools, model, name):
    world, degrees, extra = LAYOUTS[name]
    if model == "gpt" and degrees.get("cp", 1) > 1:   # learned positions under cp: refused (test below)
        model = "gpt-rope"
    for loss, grad, n in pools.run(world, _packed_vs_one_by_one, model, degrees, extra):
        assert loss < TOL and grad < TOL and n > 0, (name, loss, grad)


@pytest.mark.parametrize("model,name", [("llama", None), ("llama", "tp2 sp"), ("llama", "pp2"), ("llama", "cp2 a2a"),
                                        ("gpt-rope", "cp2 a2a")])
def test_rotary_models_take_per_document_positions_without_the_mask(pools, model, name):
    world, degrees, extra = LAYOUTS[name] if name else (1, {}, {})
    for loss, grad, moved in pools.run(world, _positions_alone, model, degrees, extra):
        assert loss < TOL and grad < TOL and moved > 1e-3, (name, loss, grad, moved)


@pytest.mark.slow
def test_compiled_blocks_take_the_mask(pools):
    # the mask is an input of every compiled block (a BlockMask on GPUs, here the dense one)
    loss, grad, n = pools.run(1, _packed_vs_one_by_one, "llama", dict(dp=1), dict(compile=True), timeout=600)[0]
    assert loss < TOL and grad < 1e-5 and n > 0, (loss, grad)


def _fp8_packed(rank, world):
    """FP8 (torchao's emulation) at dp2 against one FP8 process on the same packed batch,
    each rank's samples one of its micro-batches: fp8's scales see a micro-batch's
    tokens, so one document alone would be scaled otherwise."""
    from meshtron.distributed import float8
    from meshtron.models.llama.parallelize import FP8_SKIP
    x, y, inputs, _, _ = packed_batch()
    ref = Llama(LLAMA, seed=0)
    float8.convert(ref, "tensorwise", "cpu", skip=FP8_SKIP)
    ref_loss = float(forward_backward([ref], x, y, None, microbatches=2, inputs=inputs))
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    # the same FP8 process without the mask: what a layout that dropped it would give
    unmasked = Llama(LLAMA, seed=0)
    float8.convert(unmasked, "tensorwise", "cpu", skip=FP8_SKIP)
    without = float(forward_backward([unmasked], x, y, None, microbatches=2,
                                     inputs={k: t for k, t in inputs.items() if k != "documents"}))
    me, pcfg = mesh(dp=2), ParallelConfig(dp=2, zero=3, fp8="tensorwise")
    model = Llama(LLAMA, seed=0)
    LLAMA_SPEC.parallelize(model, me, pcfg)
    float8.precompute_scales([model])
    index, count = batch_slice(me)
    loss = forward_backward([model], x.chunk(count)[index], y.chunk(count)[index], me, zero=3,
                            inputs={k: t.chunk(count)[index] for k, t in inputs.items()})
    worst = max(rel_err(full(p.grad), ref_grads[n].float()) for n, p in model.named_parameters())
    return abs(float(loss) - ref_loss) / ref_loss, worst, abs(without - ref_loss) / ref_loss


def test_fp8_takes_the_mask(pools):
    pytest.importorskip("torchao.float8")
    for loss, grad, unmasked in pools.run(2, _fp8_packed):
        # the mask moves the loss 200x more than the tolerance: a dropped mask cannot pass
        assert loss < 1e-5 and grad < 1e-5 and unmasked > 1e-3, (loss, grad, unmasked)


def test_packed_moe_under_expert_parallelism_equals_one_by_one(pools):
    for loss, grad, n in pools.run(2, _packed_vs_one_by_one, "llama-moe", dict(dp=1, ep=2), {}):
        assert loss < TOL and grad < TOL and n > 0, (loss, grad)


def test_the_boundaries_of_a_megatron_dataset_come_from_its_index(tmp_path):
    # documents with no end-of-text id between them: only the .idx knows where they end
    docs = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    w = IndexedDatasetWriter(str(tmp_path / "ds"), 320)
    for d in docs:
        w.add(d)
    w.close()
    src = open_data(str(tmp_path / "ds"), 320, documents=True)
    assert src.starts.tolist() == [0, 3, 4, 9]
    assert src.documents(0, 5).tolist() == [0, 0, 0, 1, 2, 2]
    assert src.documents(1, 5).tolist() == [0, 0, 0, 0, 1, 1]
    # text: after each end-of-text id; a token file needs its tokenizer to know that id
    stream = np.array([1, 2, EOT, 3, EOT, 4], dtype=np.uint16)
    assert document_starts(None, stream).tolist() == [0, 3, 5]
    np.array([1, 2], dtype=np.uint16).tofile(tmp_path / "t.u16")
    with pytest.raises(ValueError, match="token file: its documents end at the end-of-text id"):
        open_data(str(tmp_path / "t.u16"), 320, documents=True)


def test_a_cp_variant_that_takes_no_mask_is_refused_with_one_line():
    for variant in ("p2p", "allgather"):
        c = Config.from_args(["--cp", "2", "--cp-comm", variant, "--document-mask"])
        with pytest.raises(ConfigError, match="--document-mask under context parallelism takes --cp-comm a2a"):
            c.validate(world_size=2)
    Config.from_args(["--cp", "2", "--cp-comm", "a2a", "--document-mask"]).validate(world_size=2)
    c = Config.from_args(["--model", "tiny", "--pos-emb", "learned", "--cp", "2", "--cp-comm", "a2a",
                          "--document-positions"])
    with pytest.raises(ConfigError, match="--document-positions under context parallelism needs rotary positions"):
        resolve_layout(c, 2)


# ---- the recipe: one process and the layouts give the same losses --------------------

FLAGS = ["--document-mask", "--document-positions", "--eod-mask-loss"]
ARGS = ["--model", "llama-tiny", "--seq-len", "64", "--steps", "6", "--global-batch", "4", "--micro-batch", "2",
        "--log-interval", "1"]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A directory of 120 text files of 4 to 40 bytes (each file is a document): every
    64-token sample holds several documents."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("docs")
    words = ["the", "a", "cat", "sat", "on", "mat", "dog", "ran", "far", "and", "then", "slept", "here"]
    for i in range(120):
        text = " ".join(rng.choice(words, rng.integers(1, 9)))
        (root / f"{i:03d}.txt").write_text(text + ".")
    return str(root)


def _metrics(pools, world, argv, path, key="loss"):
    pools.run(world, train, argv + ["--metrics-file", str(path)])
    return [json.loads(line)[key] for line in path.read_text().splitlines() if f'"{key}"' in line]


@pytest.fixture(scope="module")
def one_process_losses(pools, tmp_path_factory, short_documents):
    return _metrics(pools, 1, ARGS + FLAGS + ["--data", short_documents], tmp_path_factory.mktemp("one") / "m.jsonl")


def test_the_recipes_documents_hold_several_per_sample_and_each_flag_moves_the_loss(pools, tmp_path, short_documents,
                                                                                      one_process_losses):
    src = open_data(short_documents, 320, documents=True)
    loader = BatchLoader(src, 64, 4, shuffle=False)
    for _ in range(6):
        _, _, documents = loader.next_batch()
        assert all(len(row.unique()) >= 3 for row in documents), documents
    # each flag off in turn gives another loss at every step; the Llama's rotary positions are relative,
    # so --document-positions shows without the mask (under it no offset changes a score), and at random
    # initial weights by little: one process repeats its losses bit for bit, so any difference is the flag's
    alone = _metrics(pools, 1, ARGS + ["--document-positions", "--data", short_documents], tmp_path / "p.jsonl")
    for i, (flag, on, by) in enumerate([("--document-mask", one_process_losses, 1e-4),
                                        ("--eod-mask-loss", one_process_losses, 1e-4),
                                        ("--document-positions", alone, 0)]):
        others = [f for f in FLAGS if f != flag] if on is one_process_losses else []
        losses = _metrics(pools, 1, ARGS + others + ["--data", short_documents], tmp_path / f"{i}.jsonl")
        assert len(losses) == 6 and all(abs(a - b) > by * abs(b) for a, b in zip(losses, on)), (flag, losses, on)


@pytest.mark.parametrize("flags,world", [(["--dp", "2"], 2), (["--pp", "2"], 2), (["--cp", "2", "--cp-comm", "a2a"], 2),
                                         (["--dp", "2", "--tp", "2", "--sp"], 4)],
                         ids=["dp2", "pp2", "cp2-a2a", "dp2xtp2-sp"])
@pytest.mark.fast_cases("pp2")
def test_recipe_losses_with_document_masks_equal_one_process(pools, tmp_path, one_process_losses, short_documents,
                                                             flags, world):
    many = _metrics(pools, world, ARGS + FLAGS + ["--data", short_documents] + flags, tmp_path / "m.jsonl")
    assert len(one_process_losses) == 6 and many == pytest.approx(one_process_losses, rel=1e-5)


def test_kept_pairs_is_the_share_of_causal_pairs_the_mask_keeps():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    causal = dense_mask(torch.zeros_like(docs), torch.zeros_like(docs)).sum()
    assert kept_pairs(docs) == pytest.approx(float(dense_mask(docs, docs).sum() / causal))
    assert kept_pairs(docs[1:]) == 1.0


def _logged(rank, world, argv):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(rank, world, argv)
    return printed.getvalue()


def test_the_log_counts_the_attention_the_mask_keeps_and_says_the_mask_is_on(pools, tmp_path):
    # a masked run once logged causal attention's FLOPs (MFU 120.8% at cp=4, 64K)
    cfg = models.get("llama-tiny")[1]
    (tmp_path / "docs").mkdir()
    for i in range(300):   # documents of ~20 bytes: a 64-token sample holds three or four
        (tmp_path / "docs" / f"{i}.py").write_text(f"x = {i} * {i}\nprint(x)\n")
    path = tmp_path / "m.jsonl"
    out = pools.run(1, _logged, ARGS + FLAGS + ["--data", str(tmp_path / "docs"), "--metrics-file", str(path)])[0]
    assert "| document mask on: attention FLOPs count the query-key pairs it keeps" in out.splitlines()[0], out
    step = next(line for line in out.splitlines() if line.startswith("step "))
    assert "/rank) | " in step and " GFLOP/s/rank | " in step, step    # the CPU has ranks, not GPUs
    rows = [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]
    causal = cfg.flops_per_token(64) - cfg.flops_per_token(0)   # the attention term, causal
    kept = [(r["tflops_per_gpu"] * 1e12 / r["tokens_per_s"] - cfg.flops_per_token(0)) / causal for r in rows]
    assert all(0.1 < k < 0.6 for k in kept), kept             # three or four documents a sample keep about 1/3


@pytest.mark.parametrize("flags,world", [([], 1), (["--pp", "2"], 2), (["--cp", "2", "--cp-comm", "a2a"], 2)],
                         ids=["one", "pp2", "cp2-a2a"])
def test_evaluation_reads_documents_as_training_does(pools, tmp_path, short_documents, flags, world):
    # an lr too small to move a weight: evaluating the first batch after step 1 is that step's forward
    argv = ARGS[:ARGS.index("--steps")] + ["--steps", "1", "--lr", "1e-30", "--data", short_documents,
                                           "--eval-data", short_documents, "--eval-steps", "1"] + ARGS[6:] + flags
    path = tmp_path / "m.jsonl"
    trained = _metrics(pools, world, argv + FLAGS, path)
    evaluated = [json.loads(line)["eval_loss"] for line in path.read_text().splitlines() if "eval_loss" in line]
    assert len(trained) == len(evaluated) == 1 and evaluated == pytest.approx(trained, rel=1e-5), (trained, evaluated)
