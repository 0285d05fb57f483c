"""Tokenizers: bytes (the default, no files) or a Hugging Face tokenizer.json
(GPT-2's BPE, Llama 3's, ...) read locally through the `tokenizers` library."""
from __future__ import annotations

import json
import os
import shutil


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



def _byte_tokenizer_json() -> dict:
    """ByteTokenizer as a tokenizer.json, written without the tokenizers package: a
    byte-level BPE without merges, each byte its own id, end-of-text 256 (the literal
    text <|endoftext|> encodes to it too, as in GPT-2's)."""
    # GPT-2's byte-to-character table: the byte-level pre-tokenizer's alphabet
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": ByteTokenizer.eot, "content": "<|endoftext|>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False, "special": True}],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": {c: b for b, c in chars.items()}, "merges": []}}


def export_tokenizer(spec: str | None, out: str) -> None:
    """Write the tokenizer `spec` (load_tokenizer's) into the model directory `out`, so
    that transformers' AutoTokenizer.from_pretrained(out) reads it: its tokenizer.json
    (the byte tokenizer's equivalent for bytes) and tokenizer_config.json (the
    source's own, else one naming the end-of-text token). The model's config.json and
    generation_config.json, where present, take its end of text as their bos and eos
    ids, which otherwise keep transformers' defaults (GPT-2's 50256, past a small
    vocabulary), so that generation stops where the model learnt to."""
    os.makedirs(out, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if spec in (None, "bytes"):
        with open(os.path.join(out, "tokenizer.json"), "w") as f:
            json.dump(_byte_tokenizer_json(), f, ensure_ascii=False)
        eot, config["eos_token"] = ByteTokenizer.eot, "<|endoftext|>"
    else:
        tok = HFTokenizer(spec)   # checks that it is one, and finds its end of text
        src = spec if os.path.isdir(spec) else os.path.dirname(spec)
        shutil.copyfile(os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec,
                        os.path.join(out, "tokenizer.json"))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
        eot, config["eos_token"] = tok.eot, tok.tok.id_to_token(tok.eot)
    if not os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(out, name)
        if os.path.isfile(path):
            with open(path) as f:
                model = json.load(f)
            with open(path, "w") as f:
                json.dump(model | {"bos_token_id": eot, "eos_token_id": eot}, f, indent=1)
