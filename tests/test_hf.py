"""Hugging Face checkpoints in and out: a random tiny LlamaForCausalLM and
GPT2LMHeadModel saved by transformers, imported at tp=2, give transformers'
logits and greedy continuation (through meshtron's generation); exported back,
transformers loads them with the same logits; a config that does not match the
model is refused with the differing fields; the trainer starts from them."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from meshtron import models
from meshtron.train import hf

from harness import train

transformers = pytest.importorskip("transformers")
PROMPT = [5, 17, 42, 9, 3]


def save_tiny(kind: str, path: str, vocab: int = 96):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=vocab, max_position_embeddings=64, rope_theta=1000.0, use_cache=True))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    with torch.no_grad():   # random but not degenerate: norms, biases and scales away from their init
        for p in model.parameters():
            p.mul_(1 + 0.5 * torch.rand_like(p)).add_(0.05 * torch.randn_like(p))
    model.eval().save_pretrained(path)
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(x).logits
    greedy = model.generate(x, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(PROMPT):].tolist()
    return logits, greedy


def _import_generate_export(rank, world, path, out):
    from meshtron.generate import generate, load
    device = torch.device("cpu")
    model, cfg, spec = load(SimpleNamespace(hf=path, checkpoint=None, tp=world), device)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]))
    greedy = generate(model, PROMPT, 10)
    hf.export_safetensors(model, out, cfg, spec.hf)
    return logits, greedy


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.fast_cases("gpt2")
def test_transformers_round_trip_at_tp2(pools, tmp_path, kind):
    theirs, their_greedy = save_tiny(kind, str(tmp_path / "hf"))
    logits, greedy = pools.run(2, _import_generate_export, str(tmp_path / "hf"), str(tmp_path / "out"))[0]
    torch.testing.assert_close(logits, theirs, rtol=1e-5, atol=1e-5)
    assert greedy == their_greedy
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(torch.tensor([PROMPT])).logits, theirs, rtol=1e-5, atol=1e-5)
    assert oct(os.stat(tmp_path / "out" / "model.safetensors").st_mode & 0o777) == oct(0o666 & ~_umask())
    assert json.load(open(tmp_path / "out" / "generation_config.json"))["_from_model_config"] is True


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_the_generate_recipe_prints_the_greedy_ids(pools, tmp_path):
    _, their_greedy = save_tiny("llama", str(tmp_path / "hf"))
    ids = pools.run(2, _generate_main, ["--hf", str(tmp_path / "hf"), "--tp", "2", "--prompt-ids",
                                        ",".join(map(str, PROMPT)), "--max-new-tokens", "10", "--print-ids"])[0]
    assert ids == their_greedy


def _generate_main(rank, world, argv):
    from meshtron.generate import main
    return main(argv)


def test_a_config_that_does_not_match_is_refused(tmp_path):
    save_tiny("llama", str(tmp_path / "hf"))
    spec, cfg = models.from_hf(str(tmp_path / "hf"))
    other = models.llama.LlamaConfig(n_layers=2, dim=64, n_heads=8, n_kv_heads=2, ffn_dim=128, vocab_size=96,
                                     rope_theta=1000.0, norm_eps=cfg.norm_eps)
    with pytest.raises(ValueError, match="holds weights for another model: n_heads: 4 in .*, 8 here"):
        hf.import_safetensors(spec.model_cls(other, seed=0), str(tmp_path / "hf"), other, spec.hf)
    d = json.load(open(tmp_path / "hf" / "config.json"))
    d["mlp_bias"] = True
    json.dump(d, open(tmp_path / "hf" / "config.json", "w"))
    with pytest.raises(ValueError, match="mlp_bias=True"):
        models.from_hf(str(tmp_path / "hf"))


def test_the_trainer_starts_from_a_hugging_face_model(pools, tmp_path):
    save_tiny("llama", str(tmp_path / "hf"), vocab=320)   # the default data: byte tokens up to 256
    argv = ["--init-from-hf", str(tmp_path / "hf"), "--seq-len", "32", "--steps", "2", "--global-batch", "4",
            "--lr", "1e-9", "--warmup", "1", "--log-interval", "1"]
    one = pools.run(1, train, argv + ["--micro-batch", "4"])[0]
    dp_tp = pools.run(4, train, argv + ["--dp", "2", "--tp", "2", "--sp", "--zero", "3", "--micro-batch", "2"])[0]
    assert dp_tp == pytest.approx(one, rel=1e-5)
    # the first loss is the Hugging Face model's own on that batch
    from meshtron.data import BatchLoader, load_tokens
    x, y = BatchLoader(load_tokens(None), 32, 4, seed=0).next()
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten())
    assert one[0] == pytest.approx(float(ref), rel=1e-5)


def test_the_export_holds_the_runs_tokenizer_for_transformers(pools, tmp_path):
    # issue 57, point 6: AutoTokenizer.from_pretrained(DIR) reads what --export-hf wrote, for a
    # tokenizer the run named and for the default bytes
    import sysconfig

    from meshtron.data.tokenizer import ByteTokenizer
    from meshtron.data.train_tokenizer import train_bpe
    text = os.path.join(sysconfig.get_paths()["stdlib"], "json", "decoder.py")
    bpe = train_bpe([text], 300, str(tmp_path / "tok"))
    sample = "def f(x):\n    return {'h\u00e9llo': x}  # \U0001F600\n"
    argv = ["--model", "tiny", "--seq-len", "32", "--steps", "1", "--micro-batch", "2", "--global-batch", "2"]
    for name, data, ours in (("bpe", ["--data", text, "--tokenizer", str(tmp_path / "tok")], bpe),
                             ("bytes", [], ByteTokenizer())):
        pools.run(1, train, argv + data + ["--export-hf", str(tmp_path / name)])
        theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
        assert theirs.encode(sample) == ours.encode(sample), name
        assert theirs.eos_token_id == ours.eot and theirs.decode(ours.encode(sample)) == sample, name
        config = transformers.AutoConfig.from_pretrained(str(tmp_path / name))
        assert config.eos_token_id == config.bos_token_id == ours.eot, name   # not GPT-2's 50256
