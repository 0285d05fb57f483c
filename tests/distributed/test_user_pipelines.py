"""pp=2 on models meshtron did not write (user_stages + split_model(user=)):
transformers causal LMs of 13 architectures, built from tiny random configs,
and two plain PyTorch models that do their own work outside the blocks (a
parameter-free final norm after an embedding multiplier; logit soft-capping
after the head, under a try/except Exception), trained 4 AdamW steps in fp32 at
pp=2 and at pp=2 x dp=2 (FSDP) against one process: the same losses,
gradients and final weights to 1e-5. A model whose split cannot compute what
one process computes is refused by user_stages, before any stage is built, with
a one-line error."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtron import ParallelConfig, parallelize
from meshtron.distributed.pipeline_parallel import split_model, user_stages
from meshtron.train.loss import cross_entropy_sum

from harness import mesh
from parity import assert_parity, fb_kwargs, perturbed_builder, run_parity, tiny_batches

transformers = pytest.importorskip("transformers")
VOCAB, TOL = 96, 1e-5
T = transformers
_SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)
_NO_KV = {k: v for k, v in _SIZE.items() if k != "num_key_value_heads"}

# name -> (model factory, blocks); the cut goes before the blocks' third
HF = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**_SIZE, tie_word_embeddings=True)), "model.layers"),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_SIZE)), "model.layers"),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**_SIZE)), "model.layers"),
    # embeddings times sqrt(d) before the first block
    "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**_SIZE, head_dim=16)), "model.layers"),
    # and logits soft-capped after the head, sliding-window attention
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        **_SIZE, head_dim=16, final_logit_softcapping=2.0, attn_logit_softcapping=5.0, sliding_window=8)),
        "model.layers"),
    # an embedding multiplier before the blocks, logits divided after the head
    "granite": (lambda: T.GraniteForCausalLM(T.GraniteConfig(
        **_SIZE, embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5)), "model.layers"),
    # logits times logit_scale after the head
    "cohere": (lambda: T.CohereForCausalLM(T.CohereConfig(**_SIZE, logit_scale=0.25)), "model.layers"),
    # parameter-free layer norms, the final one included
    "olmo": (lambda: T.OlmoForCausalLM(T.OlmoConfig(**_SIZE)), "model.layers"),
    "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(**_SIZE, pad_token_id=0)), "model.layers"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
        n_embd=64, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False)), "transformer.h"),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_NO_KV)), "gpt_neox.layers"),
    # a layer norm with parameters right after the embedding
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(hidden_size=64, n_layer=4, n_head=4, vocab_size=VOCAB,
                                                      use_cache=False)), "transformer.h"),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, use_cache=False)), "model.decoder.layers"),
}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.qkv, self.o = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, x0=None):
        B, S, _ = x.shape
        x = x if x0 is None else x + x0     # x0: an input every block reads (refused across a cut)
        q, k, v = (t.view(B, S, -1, 16).transpose(1, 2) for t in self.qkv(self.ln(x)).chunk(3, -1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Plain(nn.Module):
    """A user's transformer; `kind` says what its forward does outside the blocks."""

    def __init__(self, kind, d=64, n=4):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.proj = nn.Linear(d, d) if kind == "twice" else None
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.pos = nn.Parameter(torch.zeros(16, d)) if kind == "root_param" else None

    def forward(self, ids):
        h = self.emb(ids)
        if self.kind == "root_param":
            h = h + self.pos[:ids.shape[1]]
        if self.kind == "norm_free":
            h = h * 8.0                                       # an embedding multiplier
        if self.kind == "twice":
            h = self.proj(h)
        x0 = h if self.kind == "x0" else None
        try:                                                  # must not swallow a stage's cut
            for b in self.blocks:
                h = b(h, x0)
                if self.kind == "late_block" and b is self.blocks[1]:
                    early = h
        except Exception:
            h = torch.zeros_like(h)
        if self.kind == "norm_free":
            h = F.rms_norm(h, (h.shape[-1],))                 # a final norm without parameters
        if self.kind == "twice":
            h = self.proj(h)
        logits = self.head(h) if self.kind != "weight_use" else F.linear(h, self.emb.weight)
        if self.kind == "late_block":
            logits = logits + early.sum(-1, keepdim=True)     # a block's output used after the head
        if self.kind == "softcap":
            logits = torch.tanh(logits / 0.5) * 0.5           # logit soft-capping after the head
        return logits


PLAIN = {"norm_free": (lambda: Plain("norm_free"), "blocks"), "softcap": (lambda: Plain("softcap"), "blocks")}
MODELS = HF | PLAIN


def build(kind):
    return perturbed_builder(MODELS[kind][0])


LLAMA_PLAN = {"model.embed_tokens": "vocab_parallel", "model.layers.*.self_attn.q_proj": "colwise",
              "model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.v_proj": "colwise",
              "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
              "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
              "lm_head": "colwise_rep"}


def _pp(rank, world, kind, dp, tp=1, schedule="1f1b", virtual=1, recompute="none"):
    me = mesh(dp=dp, pp=2, tp=tp)
    blocks = MODELS[kind][1]
    pcfg = ParallelConfig(recompute=recompute, loss_parallel=False)
    points = [f"{blocks}.{i}" for i in ((2,) if virtual == 1 else (1, 2, 3))]

    def pipeline(model, me):
        stages, user = user_stages(model, blocks, points)
        pipe = split_model(model, me, schedule, virtual, 2, stages, user=user)
        for part in pipe.parts:     # FSDP over dp, one unit per block this stage holds
            parallelize(part, me, pcfg, plan=LLAMA_PLAN if tp > 1 else None)
        pipe.build_schedule(cross_entropy_sum)
        return pipe

    return run_parity(me, build(kind), pipeline, tiny_batches(VOCAB, steps=4, batch=8, seq=16), max_norm=1.0,
                      fb_kwargs=fb_kwargs(me, pcfg))


@pytest.mark.parametrize("kind", MODELS)
def test_pp2_matches_one_process(pools, kind):
    worst = assert_parity(pools.run(2, _pp, kind, 1), TOL)
    print(f"{kind} pp2: loss {worst.loss:.2g} grad {worst.grad:.2g} param {worst.param:.2g}")


# FSDP on each stage does not depend on the architecture (the split, which does, is the pp2 test's for
# every model): a tied Llama, GPT-2's Conv1D and tied head, and Gemma2's soft-capping and sliding windows
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2"])
@pytest.mark.fast_cases("gpt2")
def test_pp2_x_dp2_matches_one_process(pools, kind):
    worst = assert_parity(pools.run(4, _pp, kind, 2), TOL)
    print(f"{kind} pp2 x dp2: loss {worst.loss:.2g} grad {worst.grad:.2g} param {worst.param:.2g}")


@pytest.mark.parametrize("kind, layout", [
    ("llama", dict(tp=2)),                                          # stand-ins are left out of the TP plan
    ("gemma2", dict(schedule="interleaved-1f1b", virtual=2)),       # 4 stages, two per rank
    ("softcap", dict(schedule="zbv", virtual=2)),
    ("granite", dict(recompute="full")),                            # the received input is what is kept
])
@pytest.mark.fast_cases("gemma2-layout1", "softcap-layout2", "granite-layout3")
def test_pp2_with_other_axes_and_schedules(pools, kind, layout):
    world = 2 * layout.get("tp", 1)
    worst = assert_parity(pools.run(world, _pp, kind, 1, **layout), TOL)
    print(f"{kind} pp2 {layout}: loss {worst.loss:.2g} grad {worst.grad:.2g} param {worst.param:.2g}")


def _evaluate(rank, world, kind):
    me = mesh(dp=1, pp=2)
    blocks = MODELS[kind][1]
    model = build(kind)()
    stages, user = user_stages(model, blocks, [f"{blocks}.2"])
    pipe = split_model(model, me, "1f1b", 1, 2, stages, user=user)
    pipe.build_schedule(cross_entropy_sum)
    x, y = tiny_batches(VOCAB, steps=1, batch=4, seq=16)[0]
    with torch.no_grad():
        ref = cross_entropy_sum(model(x).logits if kind in HF else model(x), y)
    loss = pipe.evaluate(x, y)      # the last stage's, 0 on the others
    torch.distributed.all_reduce(loss, group=me["pp"].get_group())
    return float(ref), float(loss)


def test_pp2_evaluates_like_one_process(pools):
    for ref, got in pools.run(2, _evaluate, "gemma2"):
        assert got == pytest.approx(ref, rel=TOL)


@pytest.mark.parametrize("kind, why", [
    ("x0", r"another output than one process .* crosses the cut at blocks.2"),
    ("twice", r"proj \(with parameters\) is called on pipeline stages \[0, 1\]"),
    ("late_block", r"another output than one process"),
    ("root_param", r"parameters \['pos'\] sit directly on Plain, which every pipeline stage runs"),
    ("weight_use", r"stage 1 of Plain fails on the probe batch: AttributeError: emb is held by another pipeline stage"),
])
def test_unsplittable_models_are_refused_with_one_line(kind, why):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=why) as err:
        user_stages(Plain(kind), "blocks", ["blocks.2"])
    assert "\n" not in str(err.value)


def test_stages_by_call_order():
    probe = torch.randint(0, VOCAB, (3, 9))
    stages, user = user_stages(build("opt")(), "model.decoder.layers", ["model.decoder.layers.1",
                                                                       "model.decoder.layers.3"], probe=probe)
    assert stages == [["model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.layers.0"],
                      ["model.decoder.layers.1", "model.decoder.layers.2"],
                      ["model.decoder.layers.3", "model.decoder.final_layer_norm", "lm_head"]]
    assert user.n_stages == 3
    with pytest.raises(ValueError, match="not blocks of model.layers"):
        user_stages(build("llama")(), "model.layers", ["model.layers.9"])


def test_stand_ins_take_the_dtype_of_the_hidden_states_received():
    """Probed in fp32, run in bf16 (as under FSDP's mixed precision): the rotary
    tables a later stage derives from its stand-in embedding are bf16, as in one
    bf16 process, so the stages give its logits bit for bit."""
    model = build("llama")()
    _, user = user_stages(model, "model.layers", ["model.layers.2"])
    half = model.to(torch.bfloat16)
    first, last = (user.build(half, s) for s in range(2))
    x = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        out, ref = last(first(x, ids=x), ids=x), half(x).logits
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
