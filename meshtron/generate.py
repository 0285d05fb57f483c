"""Sampling from a trained model, in one process or under torchrun with tensor
parallelism: the prompt goes through in one forward (prefill), then one token at
a time through a KV cache; greedy, or temperature / top-k / top-p sampling.

    python recipes/generate.py --hf DIR --prompt "def main(" --max-new-tokens 64
    torchrun --nproc-per-node 2 recipes/generate.py --tp 2 --checkpoint ck/step-00000100 --prompt-ids 1,2,3 \\
        --print-ids

Under tensor parallelism every rank holds its heads' cache, the logits are
gathered (a replicated output head), and every rank draws the same token from
the same seed, so all ranks keep the same sequence without communicating it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from meshtron import models
from meshtron.command_line import OneLineParser
from meshtron.config import ParallelConfig
from meshtron.distributed.agree import agree
from meshtron.distributed.mesh import init_mesh
from meshtron.distributed.tied import materialize
from meshtron.models.common.kv_cache import KVCache
from meshtron.train import checkpoint, hf
from meshtron.train.lifetime import init_process_group


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
           generator: torch.Generator) -> torch.Tensor:
    """(B, vocab) fp32 logits -> (B,) token ids; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p        # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos: int | None = None, seed: int = 0,
             max_len: int | None = None) -> list[int]:
    """The new tokens after `prompt` (stops at `eos`, which is included)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    cache, tokens, out = KVCache(), torch.tensor([prompt], device=device), []
    for _ in range(max_new_tokens):
        if max_len is not None and cache.length + tokens.shape[1] > max_len:
            break
        positions = torch.arange(cache.length, cache.length + tokens.shape[1], device=device)
        logits = model(tokens, positions, cache=cache)[:, -1].float()
        cache.length += tokens.shape[1]
        nxt = sample(logits, temperature, top_k, top_p, g)
        out.append(int(nxt[0]))
        if eos is not None and out[-1] == eos:
            break
        tokens = nxt[:, None]
    return out


def _one_checkpoint(path: str) -> str:
    """A checkpoint, or a --checkpoint-dir holding them: its newest sound one."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "meshtron.json")) \
            and checkpoint.list_checkpoints(path):
        newest, _ = checkpoint.latest_good(path)
        if newest is None:
            raise checkpoint.CheckpointError(f"no sound checkpoint in {path}: every step-* in it failed validation")
        return newest
    return path


def _tokenizer(args, meta: dict | None):
    """--tokenizer; else the Hugging Face directory's own, or the one the checkpoint's
    training text was read with (the byte tokenizer for checkpoints that record none).
    A tokenizer other than the one the checkpoint trained with is refused where the
    vocabularies differ, and so is text for a checkpoint trained on token ids."""
    from meshtron.data.tokenizer import load_tokenizer
    if args.hf:
        return load_tokenizer(args.tokenizer or (
            args.hf if os.path.isfile(os.path.join(args.hf, "tokenizer.json")) else "bytes"))
    trained = meta.get("tokenizer", "bytes")     # checkpoints before the record: the old default
    if trained is None and args.tokenizer is None:
        raise ValueError(f"{args.checkpoint} was trained on token ids (its tokenizer is not recorded): pass "
                         "--tokenizer, or --prompt-ids with --print-ids")
    tokenizer = load_tokenizer(args.tokenizer or trained)
    if trained is not None and args.tokenizer is not None:
        own = load_tokenizer(trained) if trained == "bytes" or os.path.exists(trained) else None
        if own is not None and own.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"--tokenizer {args.tokenizer} has {tokenizer.vocab_size} tokens; {args.checkpoint} "
                             f"was trained with {trained} ({own.vocab_size})")
    return tokenizer


def load(args, device: torch.device, meta: dict | None = None):
    """(model, model config, spec), built on the meta device, parallelized over tp,
    then given the weights of a Hugging Face directory or a meshtron checkpoint
    (`meta`: its record, checkpoint.validate's)."""
    mesh = init_mesh(dp=1, tp=args.tp, device_type=device.type)
    with agree():
        if args.hf:
            spec, cfg = models.from_hf(args.hf)
        else:
            spec, cfg = models.from_checkpoint(meta or checkpoint.validate(args.checkpoint, verify_crc=False))
        spec.check_layout(cfg, dict(dp=1, pp=1, cp=1, tp=args.tp, ep=1), ParallelConfig(tp=args.tp), 1)
        with torch.device("meta"):
            model = spec.model_cls(cfg, seed=None)
        spec.parallelize(model, mesh, ParallelConfig(tp=args.tp, loss_parallel=False))
        materialize(model, device)
        model.init_weights(0)     # buffers (rotary frequencies); every weight is loaded next
        if args.hf:
            hf.import_safetensors(model, args.hf, cfg, spec.hf)
    if not args.hf:
        checkpoint.load(args.checkpoint, [model], config=cfg)
    return model.eval(), cfg, spec


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated integers, not {text!r}") from None


def _check_ids(prompt: list[int], vocab_size: int) -> None:
    """An id outside the vocabulary would otherwise fail deep in the embedding's lookup."""
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        e = ValueError(f"--prompt-ids: token id {bad} is outside the model's vocabulary of {vocab_size} "
                       f"(ids 0 to {vocab_size - 1})")
        e.all_ranks = True   # every rank checks the same ids: the launcher prints it once
        raise e


def main(argv=None) -> list[int]:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="a Hugging Face model directory (config.json + safetensors)")
    src.add_argument("--checkpoint", help="a meshtron checkpoint (DIR/step-N), or a --checkpoint-dir (its newest)")
    p.add_argument("--prompt", help="text, encoded with --tokenizer")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json directory, or 'bytes' (default: --hf DIR's own, else bytes)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set whose mass reaches p")
    p.add_argument("--eos", type=int, default=None, help="stop at this id (default: the tokenizer's end of text, "
                   "with --prompt)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same on every rank)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (run under torchrun)")
    p.add_argument("--print-ids", action="store_true", help="print the generated ids as one comma-separated line")
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.prompt_ids is None):
        p.error("give one of --prompt and --prompt-ids")
    meta = None
    if args.checkpoint:   # its record, read once here; checkpoint.load checks every file's CRC
        args.checkpoint = _one_checkpoint(args.checkpoint)
        meta = checkpoint.validate(args.checkpoint, verify_crc=False)
    init_process_group(600)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = None
    if args.prompt is not None or not args.print_ids:   # text in or out
        tokenizer = _tokenizer(args, meta)
    prompt = _prompt_ids(args.prompt_ids) if args.prompt_ids else tokenizer.encode(args.prompt)
    model, cfg, _ = load(args, device, meta)
    if args.prompt_ids:
        _check_ids(prompt, cfg.vocab_size)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, eos=args.eos if args.eos is not None or args.prompt_ids else tokenizer.eot,
                   seed=args.seed,
                   max_len=cfg.max_seq_len)
    if dist.get_rank() == 0:
        print(",".join(map(str, out)) if args.print_ids else tokenizer.decode(prompt + out), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
