"""FP8 training (--fp8, meshtron.distributed.float8) on gloo, through torchao's
emulation: real fp8 rounding of every matmul operand, the matmuls in fp32. So
each layout is compared with one FP8-emulated process (not with bf16): same
model, seed and batches, the reference's micro-batches the ranks' own, several
AdamW steps; what converts and what stays high precision; checkpoints written
by FP8 runs load into plain ones and back; --export-hf writes plain tensors."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from meshtron import ParallelConfig, parallelize
from meshtron.distributed import float8
from meshtron.models import GPT, gpt_config
from meshtron.models.common.moe import MoEConfig
from meshtron.models.gpt import SPEC as GPT_SPEC
from meshtron.models.gpt.parallelize import FP8_SKIP as GPT_FP8_SKIP
from meshtron.models.llama import SPEC as LLAMA_SPEC
from meshtron.models.llama import Llama, LlamaConfig
from meshtron.models.llama.parallelize import FP8_SKIP
from meshtron.train.loss import cross_entropy_sum

from harness import mesh
from parity import assert_parity, fb_kwargs, layout, pipelined, run_parity, tiny_batches

pytest.importorskip("torchao.float8")

CFG = LlamaConfig(n_layers=2, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=320, max_seq_len=64,
                  rope_theta=1e4)
# mixture of experts without the aux loss: its statistics would couple the ranks' tokens, and the
# FP8 reference runs each rank's tokens as a forward of its own
MOE_CFG = LlamaConfig(**{**CFG.__dict__, "moe": MoEConfig(n_experts=4, top_k=2, hidden=32, aux_loss=0.0)})
SEQ, STEPS = 16, 4
TOL = 1e-5


# the GPT: its fc1 (a LinearGeLU) converts with its GeLU kept, column-parallel under tp
GPT_CFG = gpt_config("tiny", n_layers=2, dim=64, n_heads=4, vocab_size=320, max_seq_len=64)


def _family(cfg):
    """The model spec `cfg` configures and the linears its layouts keep high precision."""
    return (LLAMA_SPEC, FP8_SKIP) if isinstance(cfg, LlamaConfig) else (GPT_SPEC, GPT_FP8_SKIP)


def _fp8_reference(recipe, cfg=CFG):
    """The one-process FP8 model: converted as the layouts convert it, nothing else."""
    spec, skip = _family(cfg)

    def build():
        m = spec.model_cls(cfg, seed=0)
        float8.convert(m, recipe, "cpu", skip=skip)
        return m
    return build


def _scaled(parallelize):
    """The layout, then the weights' fp8 scales, as the trainer computes them before its first step."""
    def apply(model, mesh):
        out = parallelize(model, mesh)
        float8.precompute_scales(getattr(out, "parts", [out]))
        return out
    return apply


def _parity(rank, world, degrees, recipe, pcfg_kwargs=None, cfg=CFG):
    me = mesh(**degrees)
    pcfg = ParallelConfig(**{k: v for k, v in degrees.items() if k != "dp"}, fp8=recipe, **(pcfg_kwargs or {}))
    batches = tiny_batches(CFG.vocab_size, steps=STEPS, batch=8, seq=SEQ)
    n_dp = degrees.get("dp", 1) * degrees.get("ep", 1)
    micro = 2 if degrees.get("pp", 1) > 1 else 1
    spec, _ = _family(cfg)
    par = _scaled(pipelined(pcfg, spec, cfg, microbatches=2) if micro == 2 else layout(pcfg, spec))
    return run_parity(me, lambda: spec.model_cls(cfg, seed=0), par, batches, max_norm=0.5,
                      fb_kwargs=fb_kwargs(me, pcfg), ref_fb_kwargs={"microbatches": n_dp * micro},
                      build_ref=_fp8_reference(recipe, cfg), rank_major=True, after_step=float8.precompute_scales)


LAYOUTS = {"one process": (1, dict(dp=1), None),
           "one process, selective recompute": (1, dict(dp=1), dict(recompute="selective")),
           "dp2 zero0 (DDP)": (2, dict(dp=2), dict(zero=0)),
           "dp2 zero2, full recompute": (2, dict(dp=2), dict(zero=2, recompute="full")),
           "dp2 zero3 (fp8 all-gather)": (2, dict(dp=2), dict(zero=3)),
           "dp4 hsdp2 zero3": (4, dict(dp=4), dict(zero=3, hsdp=2)),
           "dp2 x tp2 sp": (4, dict(dp=2, tp=2), dict(sp=True, zero=1)),
           "tp2 sp chunked": (2, dict(tp=2), dict(sp=True, tp_overlap=True, tp_overlap_comm="chunked")),
           "dp2 x tp2 sp chunked": (4, dict(dp=2, tp=2), dict(sp=True, zero=1, tp_overlap=True,
                                                              tp_overlap_comm="chunked")),
           "pp2": (2, dict(dp=1, pp=2), None),
           "MoE ep2 (dense parts FP8)": (2, dict(dp=1, ep=2), dict(zero=1)),
           "GPT dp2 x tp2 sp": (4, dict(dp=2, tp=2), dict(sp=True, zero=1))}
ROWWISE = ("one process", "dp2 zero3 (fp8 all-gather)", "dp2 x tp2 sp", "pp2", "MoE ep2 (dense parts FP8)")
FLIP_MARGIN = 3   # deterministic steps: the measured ratio is 0.95 (0.056 against 0.059)


def _flip_noise(rank, world, recipe, cfg):
    """What fp32 rounding alone does to one FP8 process over the same steps. Rowwise:
    the same model with its loss scaled by 1 + 3e-7 (a reduction-order-sized change);
    its scales are powers of two and do not absorb it. Tensorwise scales absorb a
    uniform change, so each step's updated weights move by 1e-7 relative instead,
    as summing gradients in another order does. Either way elements that sit on an
    fp8 rounding boundary flip by one fp8 step."""
    def nudged(logits, y):
        return cross_entropy_sum(logits, y) * (1 + 3e-7)

    def jitter(parts):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in (p for m in parts for p in m.parameters()):
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=g))
        float8.precompute_scales(parts)

    rowwise = recipe == "rowwise"
    return run_parity(mesh(dp=1), _fp8_reference(recipe, cfg), lambda m, _: m,
                      tiny_batches(CFG.vocab_size, steps=STEPS, batch=8, seq=SEQ), max_norm=0.5,
                      fb_kwargs={"loss_fn": nudged} if rowwise else None, after_step=None if rowwise else jitter)


@pytest.mark.parametrize("name,recipe", [(n, "tensorwise") for n in LAYOUTS] + [(n, "rowwise") for n in ROWWISE])
@pytest.mark.fast_cases("one process-tensorwise", "one process-rowwise", "one process, selective recompute-tensorwise",
                        "dp2 zero3 (fp8 all-gather)-tensorwise", "dp2 x tp2 sp-tensorwise", "pp2-tensorwise",
                        "tp2 sp chunked-tensorwise",
                        "MoE ep2 (dense parts FP8)-tensorwise")
def test_fp8_layouts_match_one_fp8_process(pools, name, recipe):
    """Within TOL, or, where the layout sums gradients (or, under tp, activations) in
    another order than one process, which moves rounding-boundary elements by an fp8
    step, within FLIP_MARGIN x one process's own flip noise."""
    world, degrees, kwargs = LAYOUTS[name]
    cfg = MOE_CFG if "MoE" in name else GPT_CFG if "GPT" in name else CFG
    reports = pools.run(world, _parity, degrees, recipe, kwargs, cfg, timeout=300)
    tol, loss_tol, norm_tol = TOL, TOL, 100 * TOL
    if world > 1:
        noise = pools.run(1, _flip_noise, recipe, cfg)[0]
        print(f"\none {recipe} process' flip noise: {noise.worst:.2g} (loss {noise.loss:.2g}, "
              f"grad norm {noise.grad_norm:.2g})")
        tol = max(TOL, FLIP_MARGIN * noise.worst)
        # flips move single elements by an fp8 step and the loss and gradient norm a little (the
        # GPT's fp8 fc1, behind a GeLU, by 2.7e-5 and 1.3e-3 in one process); a layout's mistake
        # (a lost reduction, a wrong scale) moves them by far more
        loss_tol, norm_tol = max(loss_tol, FLIP_MARGIN * noise.loss), max(norm_tol, FLIP_MARGIN * noise.grad_norm)
    worst = assert_parity(reports, tol)
    assert max(r.loss for r in reports) <= loss_tol and max(r.grad_norm for r in reports) <= norm_tol, worst
    print(f"\n{name} {recipe}: loss {worst.loss:.2g} grad {worst.grad:.2g} ({worst.worst_grad_name}) "
          f"param {worst.param:.2g} norm {worst.grad_norm:.2g}")


def test_what_converts_and_what_stays_high_precision():
    llama = Llama(LlamaConfig(n_layers=1, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=320,
                              moe=MoEConfig(n_experts=4, top_k=2, hidden=32, n_shared=1)), seed=0)
    names = float8.convert(llama, "tensorwise", "cpu", skip=FP8_SKIP)
    assert names == ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv",
                     "layers.0.attention.wo"]   # the MoE's router (an nn.Linear) and experts (3-D) stay
    gpt = GPT(gpt_config("tiny", n_layers=1, dim=64, n_heads=4, vocab_size=320), seed=0)
    gpt.layers["0"].attn.proj = torch.nn.Linear(64, 72)   # a dim that is no multiple of 16
    fc1 = gpt.layers["0"].mlp.fc1    # a LinearGeLU: converted with its GeLU kept
    names = float8.convert(gpt, "tensorwise", "cpu", skip=("output",))
    assert names == ["layers.0.attn.qkv", "layers.0.mlp.fc1", "layers.0.mlp.fc2"]
    x = torch.randn(3, 5, 64, requires_grad=True)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256))
    float8.convert(plain, "tensorwise", "cpu")
    with torch.no_grad():
        plain[0].weight.copy_(fc1.weight), plain[0].bias.copy_(fc1.bias)
    y = gpt.layers["0"].mlp.fc1(x)
    torch.testing.assert_close(y, torch.nn.functional.gelu(plain[0](x), approximate="tanh"), rtol=0, atol=0)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    (gx_ref,) = torch.autograd.grad(torch.nn.functional.gelu(plain[0](x), approximate="tanh").square().sum(), x)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=0)
    before = {n for n, _ in Llama(CFG, seed=0).named_parameters()}
    m = _fp8_reference("tensorwise")()
    assert {n for n, _ in m.named_parameters()} == before   # the same names: checkpoints and HF export unchanged
    # a user model through meshtron.parallelize: its head (lm_head) stays, at tp 2 only dims of 32k convert
    assert not float8.convertible("lm_head", torch.nn.Linear(64, 64), float8.DEFAULT_SKIP)
    assert not float8.convertible("x", torch.nn.Linear(64, 48), (), tp=2)


def test_refused_combinations_fail_before_anything_runs():
    from meshtron import Config
    from meshtron.command_line import parser
    from meshtron.config import SECTIONS, ConfigError
    assert "the output head, MoE routers and experts" in " ".join(parser(SECTIONS).format_help().split())
    with pytest.raises(ConfigError, match="leave out --dtype fp32"):
        Config.from_args(["--tp", "2", "--fp8", "tensorwise", "--dtype", "fp32"]).validate(2)


def _user_model(rank, world):
    """meshtron.parallelize on a plain model: FP8 under FSDP dp2 matches its one-process FP8 self."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(64, 32)
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                                  torch.nn.Linear(64, 32)) for _ in range(2))
            self.lm_head = torch.nn.Linear(32, 64)

        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = h + b(h)
            return self.lm_head(h)

    def ref():
        m = Net()
        float8.convert(m, "tensorwise", "cpu")
        return m
    me = mesh(dp=2)
    pcfg = ParallelConfig(fp8="tensorwise", zero=3)
    par = _scaled(lambda m, mesh_: parallelize(m, mesh_, pcfg))
    batches = tiny_batches(64, steps=3, batch=4, seq=8)
    report = run_parity(me, Net, par, batches, fb_kwargs={"zero": 3}, ref_fb_kwargs={"microbatches": 2},
                        build_ref=ref, rank_major=True, after_step=float8.precompute_scales)
    return report


def test_user_models_through_parallelize(pools):
    worst = assert_parity(pools.run(2, _user_model), TOL)
    print(f"\nuser model dp2 zero3 fp8: grad {worst.grad:.2g} param {worst.param:.2g}")


RUN = ["--model", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "4", "--dp", "2", "--zero", "3",
       "--checkpoint-interval", "2", "--log-interval", "100"]


def _weights(trainer) -> dict:
    from parity import full
    return {n: full(p) for m in trainer.parts for n, p in m.named_parameters()}


def _resume_across_precisions(rank, world, directory, export):
    from meshtron import Config, Trainer, models
    args = RUN + ["--checkpoint-dir", directory]

    def trainer(fp8, *more):
        return Trainer(Config.from_args(args + ["--fp8", fp8, *more], models=models.PRESETS), verbose=False)
    fp8 = trainer("tensorwise")
    fp8.train(exit_after=2)                              # saves step 2
    plain = trainer("none", "--resume", "auto")
    same = [_weights(plain)[n].equal(w) for n, w in _weights(fp8).items()]
    losses = plain.train(exit_after=2)                   # steps 3, 4 in fp32; saves step 4
    again = trainer("tensorwise", "--resume", "auto", "--steps", "5", "--schedule-override", "--export-hf", export)
    same_back = [_weights(again)[n].equal(w) for n, w in _weights(plain).items()]
    losses += again.train()                              # step 5 in FP8, then the export
    return plain.start, again.start, all(same), all(same_back), losses, _weights(again)


@pytest.mark.slow
def test_fp8_checkpoints_resume_in_high_precision_and_back(pools, tmp_path):
    out = pools.run(2, _resume_across_precisions, str(tmp_path / "ck"), str(tmp_path / "hf"), timeout=300)
    start_plain, start_fp8, same, same_back, losses, weights = out[0]
    assert (start_plain, start_fp8) == (2, 4)
    assert same and same_back, "a checkpoint did not load the weights it saved"
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # --export-hf of the FP8 run: ordinary tensors under Hugging Face's names, the trained weights
    files = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    tensors = {}
    for f in files:
        tensors.update(load_file(str(tmp_path / "hf" / f)))
    assert "model.layers.0.mlp.down_proj.weight" in tensors and "lm_head.weight" not in tensors   # tied head
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.layers.0.mlp.down_proj.weight"].equal(weights["layers.0.feed_forward.w2.weight"])
    assert json.load(open(tmp_path / "hf" / "config.json"))["num_hidden_layers"] == 4


# compiled blocks round some fp8 casts differently from eager (inductor fuses the scaling): a few
# elements land one fp8 step apart; measured 1.8e-3 on the gradients (wk), 2.7e-5 on the weights
COMPILE_TOL = 1e-2


@pytest.mark.slow
def test_compiled_fp8_blocks_match_eager_fp8(pools):
    reports = pools.run(1, _parity, dict(dp=1), "tensorwise", dict(compile=True), timeout=600)
    worst = assert_parity(reports, COMPILE_TOL)
    print(f"\ncompiled fp8: loss {worst.loss:.2g} grad {worst.grad:.2g} ({worst.worst_grad_name}) "
          f"param {worst.param:.2g}")
