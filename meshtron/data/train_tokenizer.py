"""Train a byte-level BPE tokenizer (GPT-2's kind) on local text files, no download.

    python -m meshtron.data.train_tokenizer FILES_OR_DIRS ... --vocab-size 8192 --out tok/
"""
from __future__ import annotations

import argparse
import os
import sys

from meshtron.data.sources import text_files
from meshtron.data.tokenizer import HFTokenizer


def _lines(files: list[str]):
    # what the tokenizers library's own file reader feeds its trainer (lines, their endings kept),
    # but a file that is not UTF-8 (a directory's __pycache__) is read as --data reads it
    for path in files:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            yield from f


def train_bpe(files: list[str], vocab_size: int, out: str, eot: str = "<|endoftext|>") -> HFTokenizer:
    """A byte-level BPE (GPT-2's kind) trained on local text files (a directory: every
    file under it, as --data reads it), saved to out/tokenizer.json."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError("training a tokenizer needs the tokenizers package: pip install tokenizers") from None
    files = [f for path in files for f in text_files(path)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # no progress bar: off a terminal it prints only blank lines
    tok.train_from_iterator(_lines(files), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eot], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    return HFTokenizer(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer on local text files.")
    p.add_argument("files", nargs="+", help="text files, or directories (every file under them)")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary")
    p.add_argument("--out", required=True, help="directory for tokenizer.json")
    a = p.parse_args(argv)
    try:
        t = train_bpe(a.files, a.vocab_size, a.out)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"{a.out}/tokenizer.json: {t.vocab_size} tokens, end of text {t.eot}")


if __name__ == "__main__":
    main()
