"""Train a byte-level BPE tokenizer (GPT-2's kind) on local text files, no download.

    python -m meshtron.data.train_tokenizer FILES ... --vocab-size 8192 --out tok/
"""
from __future__ import annotations

import argparse
import os

from meshtron.data.tokenizer import HFTokenizer


def train_bpe(files: list[str], vocab_size: int, out: str, eot: str = "<|endoftext|>") -> HFTokenizer:
    """A byte-level BPE (GPT-2's kind) trained on local text files, saved to out/tokenizer.json."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError("training a tokenizer needs the tokenizers package: pip install tokenizers") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eot],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    return HFTokenizer(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer on local text files.")
    p.add_argument("files", nargs="+", help="text files")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary")
    p.add_argument("--out", required=True, help="directory for tokenizer.json")
    a = p.parse_args(argv)
    t = train_bpe(a.files, a.vocab_size, a.out)
    print(f"{a.out}/tokenizer.json: {t.vocab_size} tokens, end of text {t.eot}")


if __name__ == "__main__":
    main()
