import contextlib
import io
import os
import shutil
import subprocess
import sys

import pytest
import torch

from meshtron.models import GPT, gpt_config
from meshtron.models.gpt import hf as gpt2
from meshtron.train import checkpoint, hf

from harness import RankError, run_script
from harness import train as _train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--model", "tiny", "--untie-embeddings", "--steps", "6", "--seq-len", "32", "--global-batch", "8",
          "--log-interval", "100", "--warmup", "2"]
LAYOUTS = {
    "dp2-zero3": (2, ["--dp", "2", "--zero", "3", "--micro-batch", "4"]),
    "tp2-sp": (2, ["--tp", "2", "--sp", "--micro-batch", "8"]),
    "pp2": (2, ["--pp", "2", "--microbatches", "4", "--micro-batch", "2"]),
    "dp2-tp2-zero3": (4, ["--dp", "2", "--tp", "2", "--sp", "--zero", "3", "--micro-batch", "4"]),
    "tp4": (4, ["--tp", "4", "--micro-batch", "8"]),
    "dp4-zero1": (4, ["--dp", "4", "--zero", "1", "--micro-batch", "2"]),
    "pp2-dp2": (4, ["--pp", "2", "--dp", "2", "--microbatches", "2", "--micro-batch", "2"]),
    "single": (1, ["--micro-batch", "8"]),
}


def run(pools, layout, *extra, exit_after=None):
    world, flags = LAYOUTS[layout]
    return pools.run(world, _train, COMMON + flags + list(extra), exit_after, timeout=300)[0]


# dp2 x tp2 + SP resumes under every other layout in test_resharding_on_load
@pytest.mark.parametrize("layout", ["dp2-zero3", "pp2"])
def test_exact_resume(pools, tmp_path, layout):
    straight = run(pools, layout)
    first = run(pools, layout, "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", exit_after=3)
    assert checkpoint.latest(str(tmp_path)).endswith("step-00000003")
    second = run(pools, layout, "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", "--resume", "auto")
    assert first + second == straight          # bit for bit in float32 on the CPU


@pytest.fixture(scope="module")
def dp2_tp2_run(pools, tmp_path_factory):
    """The 3-D run straight through, and a copy of it saved at step 3: every target resumes the same save."""
    saved = tmp_path_factory.mktemp("dp2-tp2-zero3")
    straight = run(pools, "dp2-tp2-zero3")
    run(pools, "dp2-tp2-zero3", "--checkpoint-dir", str(saved), "--checkpoint-interval", "3", exit_after=3)
    return straight, saved


@pytest.mark.parametrize("target", ["tp4", "dp4-zero1", "pp2-dp2", "single"])
@pytest.mark.fast_cases("single", "pp2-dp2")
def test_resharding_on_load(pools, tmp_path, dp2_tp2_run, target):
    straight, saved = dp2_tp2_run
    shutil.copytree(saved, tmp_path / "ck")
    after = run(pools, target, "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto",
                "--checkpoint-interval", "100")
    assert after == pytest.approx(straight[3:], rel=1e-5), (after, straight[3:])
    if target == "single":   # and the straight 3-D run is one process' run
        assert straight == pytest.approx(run(pools, "single"), rel=1e-5)


def test_killed_save_leaves_previous_checkpoint_loadable(pools, tmp_path):
    run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", exit_after=3)
    with pytest.raises(RankError, match="died"):
        pools.run(2, _die_during_save, COMMON + LAYOUTS["dp2-zero3"][1] + ["--checkpoint-dir", str(tmp_path),
                  "--checkpoint-interval", "3", "--resume", "auto"], timeout=120)
    assert any(d.startswith(".tmp-step-00000006") for d in os.listdir(tmp_path))   # the half-written save
    assert checkpoint.latest(str(tmp_path)).endswith("step-00000003")
    checkpoint.validate(checkpoint.latest(str(tmp_path)))
    straight = run(pools, "dp2-zero3")
    resumed = run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3",
                  "--resume", "auto")
    assert resumed == straight[3:]
    assert not any(d.startswith(".tmp") for d in os.listdir(tmp_path))   # cleared by the run that took the directory


def _die_during_save(rank, world, argv):
    import meshtron.train.checkpoint as ck
    real = ck.dcp.save

    def dying_save(sd, checkpoint_id):
        if rank == 1:
            os._exit(9)            # killed before writing its shard; rank 0 is inside the save
        return real(sd, checkpoint_id=checkpoint_id)

    ck.dcp.save = dying_save
    try:
        return _train(rank, world, argv)
    finally:
        ck.dcp.save = real


def test_bad_checkpoints_fail_clearly_and_nothing_is_overwritten(pools, tmp_path):
    run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", exit_after=3)
    ck = checkpoint.latest(str(tmp_path))
    model = GPT(gpt_config("tiny", tie_embeddings=False), seed=0)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint directory"):
        checkpoint.load(str(tmp_path / "missing"), [model])
    other = gpt_config("tiny", tie_embeddings=False, n_layers=2)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"for another model: it holds tiny \(n_layers=4 there, 2 here"):
        checkpoint.load(ck, [GPT(other, seed=0)], config=other)
    with pytest.raises(checkpoint.CheckpointError, match="has no tensor 'model.adapter.weight'"):
        checkpoint.load(ck, [torch.nn.ModuleDict({"adapter": torch.nn.Linear(3, 5)})])
    odd = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.ModuleDict(
        {"mlp": torch.nn.ModuleDict({"fc1": torch.nn.Linear(3, 5)})})})})
    with pytest.raises(checkpoint.CheckpointError, match=r"fc1.weight has shape \(256, 64\), this model's is \(5, 3\)"):
        checkpoint.load(ck, [odd])
    before = {f: open(os.path.join(ck, f), "rb").read() for f in os.listdir(ck)}
    bad = str(tmp_path / "bad")
    shutil.copytree(ck, bad)
    shard = next(f for f in os.listdir(bad) if f.endswith(".distcp"))
    with open(os.path.join(bad, shard), "r+b") as f:                   # flip one byte
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(checkpoint.CheckpointError, match="corrupted"):
        checkpoint.load(bad, [model])
    with open(os.path.join(bad, shard), "r+b") as f:                   # truncate
        f.truncate(50)
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.load(bad, [model])
    os.remove(os.path.join(bad, "meshtron.json"))
    with pytest.raises(checkpoint.CheckpointError, match="not a complete meshtron checkpoint"):
        checkpoint.load(bad, [model])
    assert {f: open(os.path.join(ck, f), "rb").read() for f in os.listdir(ck)} == before
    with pytest.raises(checkpoint.CheckpointError, match="already exists"):
        checkpoint.save(str(tmp_path), 3, [model], torch.optim.AdamW(model.parameters()))


@pytest.mark.slow
def test_fault_recovery_under_max_restarts(pools, tmp_path):
    """Rank 1 dies at step 5; the agent (meshtron-run's, torchrun's) restarts the job, whose ranks
    are forked again from the same server and resume from step 4."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MESHTRON_CRASH_AT_STEP="5")
    cmd = [sys.executable, "-m", "meshtron.launch", "--nproc-per-node", "2", "--max-restarts", "1",
           "--standalone",
           os.path.join(ROOT, "recipes", "train.py")] + COMMON + LAYOUTS["dp2-zero3"][1] + [
           "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-interval", "2", "--resume", "auto",
           "--log-interval", "1", "--pg-timeout", "30"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stdout and "step-00000004 at step 4" in out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    assert lines[-1].startswith("step      6/6")
    logged = {int(line.split()[1].split("/")[0]): float(line.split("loss ")[1].split()[0]) for line in lines}
    straight = run(pools, "dp2-zero3")
    assert [logged[s] for s in (5, 6)] == [round(x, 4) for x in straight[4:]]   # nothing lost
    assert checkpoint.latest(str(tmp_path / "ck")).endswith("step-00000006")



def _printed(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _train(rank, world, argv)
    return out.getvalue()


def test_resuming_at_the_last_step_says_there_is_nothing_to_run(pools, tmp_path):
    # the closing line once read "done: -98 steps (101-2 of 2), -100,352 tokens"
    ck = str(tmp_path)
    run(pools, "single", "--checkpoint-dir", ck, "--checkpoint-interval", "2", exit_after=2)
    out = pools.run(1, _printed, COMMON + LAYOUTS["single"][1] + ["--steps", "2", "--checkpoint-dir", ck,
                                                                  "--resume", "auto", "--schedule-override"])[0]
    assert out.splitlines()[-1] == f"done: no step to run: resumed at step 2 and --steps is 2; checkpoints in {ck}"

# ---- safetensors export / import with Hugging Face GPT-2 ------------------------

def _export(rank, world, path, degrees, max_shard_bytes):
    from meshtron import ParallelConfig

    from harness import mesh
    from parity import layout
    cfg = gpt_config("tiny")
    model = layout(ParallelConfig(zero=3, sp=degrees.get("tp", 1) > 1))(GPT(cfg, seed=5), mesh(**degrees))
    files = hf.export_safetensors(model, path, cfg, gpt2, max_shard_bytes=max_shard_bytes)
    x = torch.arange(24).view(2, 12) % cfg.vocab_size
    return files, GPT(cfg, seed=5)(x).detach()


def test_export_loads_in_transformers_with_the_same_logits(pools, tmp_path):
    transformers = pytest.importorskip("transformers")
    files, ours = pools.run(4, _export, str(tmp_path), dict(dp=2, tp=2), 100_000)[0]
    assert len(files) > 1 and os.path.isfile(tmp_path / "model.safetensors.index.json")   # sharded + index
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    x = torch.arange(24).view(2, 12) % 320
    with torch.no_grad():
        theirs = hf(x).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def _import(rank, world, path, degrees):
    from meshtron import ParallelConfig

    from harness import mesh
    from parity import layout
    cfg = gpt_config("tiny", vocab_size=320)
    m = mesh(**degrees)
    pcfg = ParallelConfig(zero=3, sp=degrees.get("tp", 1) > 1, loss_parallel=False)
    model = layout(pcfg)(GPT(cfg, seed=None), m)   # uninitialized: everything must come from the file
    hf.import_safetensors(model, path, cfg, gpt2)
    x = torch.arange(24).view(2, 12) % cfg.vocab_size
    return model(x).detach()


def test_import_of_a_transformers_gpt2_gives_the_same_logits(pools, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=320, n_positions=256, n_embd=64, n_layer=4, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():   # non-trivial biases and norms, so a mapping mistake shows
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    x = torch.arange(24).view(2, 12) % 320
    with torch.no_grad():
        theirs = hf(x).logits
    for world, degrees in ((1, dict(dp=1)), (4, dict(dp=2, tp=2))):
        ours = pools.run(world, _import, str(tmp_path), degrees)[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ---- recovery: a corrupt newest checkpoint, a resume from an older one (issue 11, point 10) ----

def _flip_a_byte(ck_dir):
    shard = next(f for f in sorted(os.listdir(ck_dir)) if f.endswith(".distcp"))
    with open(os.path.join(ck_dir, shard), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_resume_auto_skips_a_corrupt_newest_checkpoint(pools, tmp_path):
    straight = run(pools, "dp2-zero3")
    run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3")   # step-3, step-6
    _flip_a_byte(tmp_path / "step-00000006")
    resumed = run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3",
                  "--resume", "auto")
    assert resumed == straight[3:]                              # from step 3, exactly
    assert sorted(os.listdir(tmp_path)) == [".lock", "stale-step-00000006", "step-00000003", "step-00000006"]
    checkpoint.validate(str(tmp_path / "step-00000006"))        # the new save is whole


def test_resuming_an_older_checkpoint_into_the_same_directory(pools, tmp_path):
    # the newer checkpoints are set aside (kept, never resumed), so the run's own saves do not collide
    straight = run(pools, "dp2-zero3")
    run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3")
    again = run(pools, "tp2-sp", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3",
                "--resume", str(tmp_path / "step-00000003"))
    assert again == pytest.approx(straight[3:], rel=1e-5)
    assert sorted(os.listdir(tmp_path)) == [".lock", "stale-step-00000006", "step-00000003", "step-00000006"]


def test_a_fresh_run_into_a_used_directory_is_refused_before_training(pools, tmp_path):
    run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", exit_after=3)
    with pytest.raises(RankError, match="already holds checkpoints \\(newest step-00000003\\): pass --resume auto"):
        run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path))


def test_an_empty_checkpoint_record_is_a_clear_error(tmp_path):
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "meshtron.json").write_text("")
    with pytest.raises(checkpoint.CheckpointError, match="meshtron.json is empty or not a meshtron checkpoint record"):
        checkpoint.validate(str(tmp_path / "step-00000001"))
    assert checkpoint.latest_good(str(tmp_path)) == (None, [f"{tmp_path}/step-00000001/meshtron.json is empty or "
                                                            "not a meshtron checkpoint record"])


def _one_stage_misses_a_tensor(rank, world, argv):
    import meshtron.train.checkpoint as ck
    real = ck._check_shapes

    def check(path, sd, stored):
        if rank == 1:   # the last pipeline stage
            raise ck.CheckpointError(f"checkpoint {path} has no tensor 'model.output.weight'")
        return real(path, sd, stored)

    ck._check_shapes = check
    try:
        return _train(rank, world, argv)
    except ck.CheckpointError as e:
        return str(e).splitlines()[0]
    finally:
        ck._check_shapes = real


def test_a_checkpoint_problem_one_stage_finds_stops_every_rank(pools, tmp_path):
    # issue 11, point 9: not one CheckpointError and the other ranks dying with "Connection closed by peer"
    run(pools, "dp2-zero3", "--checkpoint-dir", str(tmp_path), "--checkpoint-interval", "3", exit_after=3)
    argv = COMMON + LAYOUTS["pp2"][1] + ["--checkpoint-dir", str(tmp_path), "--resume", "auto"]
    assert pools.run(2, _one_stage_misses_a_tensor, argv, timeout=60) == [
        f"checkpoint {tmp_path}/step-00000003 has no tensor 'model.output.weight'"] * 2


def _files(root) -> dict:
    """Every file under root and its bytes."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def _recipe(*args):
    return run_script([os.path.join(ROOT, "recipes", "train.py"), *args])


def test_another_models_checkpoints_are_refused_and_left_byte_identical(tmp_path):
    # issue 36, point 2: a llama-tiny directory, then the tiny GPT pointed at it
    ck = str(tmp_path / "ck")
    llama = ["--model", "llama-tiny", "--steps", "2", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "4",
             "--log-interval", "1", "--checkpoint-dir", ck, "--checkpoint-interval", "1", "--resume", "auto"]
    first = _recipe(*llama)
    assert first.returncode == 0, first.stderr
    assert f"--resume auto: no checkpoint to resume in {ck}; starting from step 0" in first.stdout
    before = _files(ck)
    assert sorted(n.split("/")[0] for n in before if n.endswith("meshtron.json")) == ["step-00000001", "step-00000002"]
    gpt = ["--model", "tiny", "--steps", "4", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "4",
           "--checkpoint-dir", ck, "--keep-checkpoints", "1", "--checkpoint-interval", "1"]
    for resume in ("auto", os.path.join(ck, "step-00000002")):
        out = _recipe(*gpt, "--resume", resume)
        assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        # the models first, the fields that differ after them
        assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint {ck}/step-00000002 is for another model: "
                                                       "it holds llama-tiny, this run trains tiny (n_heads=8 there, "
                                                       "4 here"), out.stderr
        assert lines[0].endswith("); nothing was written"), lines[0]
        assert _files(ck) == before


def _save_another_model_beside(rank, world, root):
    """A GPT checkpoint saved with keep=1 into a directory holding two Llama checkpoints."""
    cfg = gpt_config("tiny", n_layers=2)
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(root, 3, [model], opt, config=cfg, keep=1, model="gpt", preset="tiny")
    checkpoint.save(root, 4, [model], opt, config=cfg, keep=1, model="gpt", preset="tiny")
    return sorted(os.path.basename(p) for p in checkpoint.list_checkpoints(root))


def test_retention_removes_only_checkpoints_of_its_own_model(pools, tmp_path):
    ck = str(tmp_path)
    run(pools, "single", "--checkpoint-dir", ck, "--checkpoint-interval", "1", exit_after=2)
    assert pools.run(1, _save_another_model_beside, ck)[0] == ["step-00000001", "step-00000002", "step-00000004"]


def _generate(*args):
    return run_script([os.path.join(ROOT, "recipes", "generate.py"), *args])


def test_a_run_says_what_it_wrote_and_generation_reads_its_directory(tmp_path):
    # issue 36, points 3 and 5: a line per checkpoint, a closing line, and the directory is what generation takes
    ck, metrics = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    out = _recipe("--model", "tiny", "--steps", "2", "--seq-len", "32", "--global-batch", "2", "--micro-batch", "2",
                  "--checkpoint-dir", ck, "--checkpoint-interval", "1", "--metrics-file", metrics)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line for line in lines if line.startswith("saved checkpoint")] == [
        f"saved checkpoint {ck}/step-00000001", f"saved checkpoint {ck}/step-00000002"]
    assert lines[-1].startswith("done: 2 steps (1-2 of 2), 128 tokens in "), lines[-1]
    assert ", final loss " in lines[-1] and lines[-1].endswith(f"; checkpoints in {ck}, metrics in {metrics}")
    gen = _generate("--checkpoint", ck, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--print-ids")
    assert gen.returncode == 0 and len(gen.stdout.strip().split(",")) == 4, gen.stderr
    assert checkpoint.validate(checkpoint.latest(ck))["tokenizer"] == "bytes"   # the text was read as bytes
    for bad, message in ((["--checkpoint", str(tmp_path / "nothing")], f"error: no checkpoint directory at "
                                                                       f"{tmp_path}/nothing"),
                         (["--checkpoint", ck, "--tokenizer", str(tmp_path / "no-tokenizer")], "error: ")):
        gen = _generate(*bad, "--prompt", "def ", "--max-new-tokens", "2")
        assert gen.returncode == 1 and len(gen.stderr.strip().splitlines()) == 1, gen.stderr
        assert gen.stderr.startswith(message), gen.stderr
    # issue 57, point 6: an id past the vocabulary is named, not an IndexError from the embedding
    gen = _generate("--checkpoint", ck, "--prompt-ids", "5,99999", "--print-ids")
    assert gen.returncode == 1 and gen.stderr.strip().splitlines() == [
        "error: --prompt-ids: token id 99999 is outside the model's vocabulary of 320 (ids 0 to 319)"], gen.stderr


def test_generation_refuses_text_for_a_checkpoint_trained_on_token_ids(tmp_path):
    # issue 36, point 5: not 64 replacement characters from the wrong tokenizer
    from meshtron.data import write_token_file
    data = str(tmp_path / "ids.u16")
    write_token_file(data, torch.randint(0, 300, (4096,)).numpy())
    ck = str(tmp_path / "ck")
    out = _recipe("--model", "tiny", "--steps", "1", "--seq-len", "32", "--global-batch", "2", "--micro-batch", "2",
                  "--data", data, "--checkpoint-dir", ck)
    assert out.returncode == 0, out.stderr
    assert checkpoint.validate(checkpoint.latest(ck))["tokenizer"] is None
    gen = _generate("--checkpoint", ck, "--prompt", "def ", "--max-new-tokens", "2")
    assert gen.returncode == 1 and gen.stderr.strip().splitlines() == [
        f"error: {ck}/step-00000001 was trained on token ids (its tokenizer is not recorded): pass --tokenizer, or "
        "--prompt-ids with --print-ids"], gen.stderr


def _tiny_hf_config(transformers, arch, width=32):
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=64, n_embd=width, n_layer=2, n_head=4, n_positions=64,
                                       bos_token_id=0, eos_token_id=0)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(vocab_size=64, hidden_size=width, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)


def _as_users_get_it(transformers, arch, where, width=32, version=None):
    """The config as read back from a saved model's directory (as every hub model is read); `version`
    rewrites config.json as another transformers version would have written it."""
    import json
    transformers.AutoModelForCausalLM.from_config(_tiny_hf_config(transformers, arch, width)).save_pretrained(where)
    if version:
        path = os.path.join(where, "config.json")
        stored = json.load(open(path))
        stored["transformers_version"] = version
        stored["torch_dtype"] = stored.pop("dtype")   # the name 4.x wrote
        json.dump(stored, open(path, "w"))
    return transformers.AutoConfig.from_pretrained(where)


def _hf_configs_save_and_resume(rank, world, root, arch):
    import transformers
    cfg = _as_users_get_it(transformers, arch, os.path.join(root, "model"))
    assert isinstance(cfg.dtype, torch.dtype)   # what made the save fail once
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters())
    ck = checkpoint.save(os.path.join(root, "ck"), 1, [model], opt, config=cfg)
    assert os.path.basename(ck) == "step-00000001" and os.path.isfile(os.path.join(ck, "meshtron.json"))
    resumed = 0
    for other in (cfg, _tiny_hf_config(transformers, arch),     # as built in code
                  _as_users_get_it(transformers, arch, os.path.join(root, "old"), version="4.46.0")):
        fresh = transformers.AutoModelForCausalLM.from_config(cfg)
        resumed += checkpoint.load(ck, [fresh], config=other) == 1
        for a, b in zip(model.parameters(), fresh.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    wider = _as_users_get_it(transformers, arch, os.path.join(root, "wider"), width=64)
    try:
        checkpoint.load(ck, [transformers.AutoModelForCausalLM.from_config(wider)], config=wider)
    except checkpoint.ModelMismatch as e:
        return resumed, str(e)
    return resumed, None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.fast_cases("gpt2")
def test_a_saved_transformers_config_saves_resumes_and_refuses_another(pools, tmp_path, arch):
    pytest.importorskip("transformers")
    resumed, refusal = pools.run(1, _hf_configs_save_and_resume, str(tmp_path), arch)[0]
    assert resumed == 3
    width = "n_embd" if arch == "gpt2" else "hidden_size"
    assert refusal is not None and f"{width}=32 there, 64 here" in refusal, refusal


def test_own_model_refuses_another_models_checkpoint_with_one_line(tmp_path):
    # docs/own-model.md: "a run of another model refuses it with one line, as the trainer's does"
    ck = str(tmp_path / "ck")
    transformers = pytest.importorskip("transformers")
    transformers.LlamaForCausalLM   # imported once here, not in each forked run  # noqa: B018
    own = [os.path.join(ROOT, "recipes", "own_model.py"), "--tp", "1", "--steps", "1", "--checkpoint-dir", ck]
    first = run_script(own)
    assert first.returncode == 0 and "saved checkpoint" in first.stdout, first.stderr[-3000:]
    other = run_script(own[:-4] + ["--steps", "2", "--checkpoint-dir", ck, "--hidden-size", "64"])
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 1 and other.stdout == "" and len(lines) == 1, other.stderr[-3000:]
    assert lines[0].startswith(f"error: checkpoint {ck}/step-00000001 is for another model: hidden_size=128 there, "
                               "64 here"), lines[0]
