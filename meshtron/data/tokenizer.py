"""Tokenizers: bytes (the default, no files) or a Hugging Face tokenizer.json
(GPT-2's BPE, Llama 3's, ...) read locally through the `tokenizers` library."""
from __future__ import annotations

import json
import os


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 is end-of-text. Needs no files."""

    eot = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json (a directory holding one, or the file); `eot` is the end-of-text
    id: tokenizer_config.json's eos_token, else the first of <|endoftext|>,
    <|end_of_text|>, </s> the vocabulary has."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("a tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tok = Tokenizer.from_file(file)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        names = ["<|endoftext|>", "<|end_of_text|>", "</s>"]
        if os.path.isfile(config):
            eos = json.load(open(config)).get("eos_token")
            names.insert(0, eos["content"] if isinstance(eos, dict) else eos)
        ids = [self.tok.token_to_id(n) for n in names if n]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"{file}: no end-of-text token (tokenizer_config.json's eos_token, <|endoftext|>, "
                             "<|end_of_text|> or </s>)")
        self.eot = found[0]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str | None):
    """None or "bytes": the byte tokenizer; otherwise a tokenizer.json path."""
    return ByteTokenizer() if spec in (None, "bytes") else HFTokenizer(spec)

