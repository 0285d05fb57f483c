"""Token sources: where the trainer's samples come from.

- default: the Python standard library's own *.py files (real text that ships
  with every Python; no download), as byte tokens;
- a text file, or every file of a directory (one document each): byte tokens,
  or a tokenizer's (`--tokenizer DIR`);
- a raw token file: little-endian uint16 (`.u16`, or `.bin` with no `.idx`
  beside it) or uint32 (`.u32`), documents separated by the end-of-text id;
- a Megatron indexed dataset, by its prefix (PREFIX.bin + PREFIX.idx), its
  documents packed back to back as Megatron's GPTDataset does;
- a weighted blend in Megatron's --data-path form, "0.7 PATH_A 0.3 PATH_B".

A source serves samples of seq_len + 1 tokens in a fixed order per epoch
(`Tokens`: a permutation drawn from (seed, epoch); `Blend`: each part permuted
so, interleaved in Megatron's blending order), so every layout sees the same
samples. Every token id is checked once, at load, to be below the vocabulary.
"""
from __future__ import annotations

import functools
import glob
import os
import sysconfig

import numpy as np

from meshtron.data.indexed import IndexedDataset, exists
from meshtron.data.tokenizer import ByteTokenizer, load_tokenizer


def _documents_to_tokens(docs, eot: int, dtype=np.uint16) -> np.ndarray:
    parts = []
    for d in docs:
        parts.append(np.asarray(d, dtype=dtype))
        parts.append(np.array([eot], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def stdlib_sources(root: str) -> list[str]:
    """The standard library's *.py files under `root`, sorted: not site-packages (walked
    past, not into: it can hold far more than the library itself), nor a top-level name
    with "test" in it, nor hidden files (as glob's `**/*.py` skips them)."""
    paths = []
    for d, dirs, files in os.walk(root):
        top = d == root
        dirs[:] = [x for x in dirs if x != "site-packages" and not x.startswith(".") and not (top and "test" in x)]
        paths += [os.path.join(d, f) for f in files
                  if f.endswith(".py") and not f.startswith(".") and not (top and "test" in f)]
    return sorted(paths)


@functools.cache
def _stdlib_tokens(max_bytes: int) -> np.ndarray:
    root = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for path in stdlib_sources(root):
        with open(path, "rb") as f:
            data = f.read()
        docs.append(_bytes(data))
        total += len(data)
        if total >= max_bytes:
            break
    tokens = _documents_to_tokens(docs, ByteTokenizer.eot)
    tokens.flags.writeable = False   # one array per process, shared by every run in it
    return tokens


def stdlib_tokens(max_bytes: int = 8 << 20) -> np.ndarray:
    """The standard library's sources in sorted path order, up to max_bytes, as byte
    tokens (read once per process)."""
    return _stdlib_tokens(max_bytes)


def text_files(path: str, flag: str = "") -> list[str]:
    """A text file, or every file under a directory (sorted; hidden ones skipped): the
    documents of --data PATH, and what the tokenizer trainer and the prepare tool read
    of a directory. `flag` names where the path was given, for the error."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no file or directory at {path}")
    files = sorted(p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(p))
    binary = [f for f in files if os.path.splitext(f)[1] in TOKEN_FILE_DTYPES or f.endswith(".idx")]
    if binary:
        raise ValueError(f"{flag}{path} is a directory holding token files ({os.path.basename(binary[0])}"
                         f"{', ...' if len(binary) > 1 else ''}); a directory is read as text: pass a token "
                         "file or an indexed dataset's prefix itself")
    return files


def text_tokens(path: str, tokenizer=None) -> np.ndarray:
    """A text file, or every file under a directory (sorted), one document each:
    byte tokens, or `tokenizer`'s."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no text file, directory or indexed dataset at {path}")
    files = text_files(path, "--data ")
    if tokenizer is None:
        return _documents_to_tokens([_bytes(open(p, "rb").read()) for p in files], ByteTokenizer.eot)
    dtype = np.uint16 if tokenizer.vocab_size < 65536 else np.uint32
    docs = [tokenizer.encode(open(p, encoding="utf-8", errors="replace").read()) for p in files]
    return _documents_to_tokens(docs, tokenizer.eot, dtype)


TOKEN_FILE_DTYPES = {".u16": np.uint16, ".bin": np.uint16, ".u32": np.uint32}


def token_file(path: str) -> np.ndarray:
    """A pre-tokenised file, memory-mapped (nothing is read until used)."""
    ext = os.path.splitext(path)[1]
    if ext not in TOKEN_FILE_DTYPES:
        raise ValueError(f"token file {path} must end in one of {list(TOKEN_FILE_DTYPES)} (uint16 or uint32)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no token file at {path}")
    dtype = np.dtype(TOKEN_FILE_DTYPES[ext])
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"token file {path} is empty")
    if size % dtype.itemsize:
        raise ValueError(f"token file {path} has {size} bytes, not a whole number of {dtype.name} tokens "
                         f"({dtype.itemsize} bytes each): truncated, or not a {ext} file")
    return np.memmap(path, dtype=dtype, mode="r")


def write_token_file(path: str, tokens) -> None:
    np.asarray(tokens, dtype=TOKEN_FILE_DTYPES[os.path.splitext(path)[1]]).tofile(path)


def load_tokens(source: str | None, vocab_size: int | None = None, tokenizer: str | None = None) -> np.ndarray:
    """The token ids of one source (not a blend); with `vocab_size`, every id
    checked once to be below it (an id past the vocabulary would index nothing in
    one process and, under loss parallel, fall outside every rank's shard and
    train to loss 0)."""
    if source is None or source == "stdlib":
        tokens = stdlib_tokens()
    elif exists(source) or (source.endswith(".bin") and exists(source[:-4])):
        tokens = IndexedDataset(source if exists(source) else source[:-4]).tokens
    elif os.path.splitext(source)[1] in TOKEN_FILE_DTYPES:
        tokens = token_file(source)
    else:
        tokens = text_tokens(source, load_tokenizer(tokenizer) if tokenizer else None)
    if vocab_size is not None and len(tokens):
        top = _max_id(tokens)
        if top >= vocab_size:
            where = next(i + int(np.argmax(c >= vocab_size)) for i, c in _chunks(tokens) if c.max() >= vocab_size)
            fix = f"pass --vocab-size {top + 1} or more (the vocabulary of the tokenizer that made these ids)"
            if tokenizer:
                n = load_tokenizer(tokenizer).vocab_size
                if n > top:
                    fix = f"--tokenizer {tokenizer} has {n} tokens: pass --vocab-size {n}"
            raise ValueError(f"--data {source or 'stdlib'}: token id {top} (first out-of-range id at position "
                             f"{where}) is not below the model's vocabulary size {vocab_size}; {fix}")
    return tokens


def _chunks(tokens: np.ndarray, size: int = 1 << 24):
    for i in range(0, len(tokens), size):
        yield i, np.asarray(tokens[i:i + size])


def _max_id(tokens: np.ndarray) -> int:
    """One pass in chunks: a memory-mapped file is never read whole into memory."""
    return max(int(c.max()) for _, c in _chunks(tokens))


class Tokens:
    """Samples i = tokens[i T : i T + T + 1] of one token stream, in a permutation
    drawn from (seed, epoch). `starts`: the offsets at which its documents begin
    (document_starts), for `documents`."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray | None = None):
        self.tokens, self.starts = tokens, starts

    def num_samples(self, seq_len: int) -> int:
        return max(0, (len(self.tokens) - 1) // seq_len)

    def order(self, seq_len: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        if not shuffle:
            return np.arange(self.num_samples(seq_len))
        return np.random.default_rng([seed, epoch]).permutation(self.num_samples(seq_len))

    def sample(self, i: int, seq_len: int) -> np.ndarray:
        return np.asarray(self.tokens[i * seq_len:i * seq_len + seq_len + 1], dtype=np.int64)

    def documents(self, i: int, seq_len: int) -> np.ndarray:
        """Sample i's document index of each of its tokens, its first document 0."""
        if self.starts is None:
            raise ValueError("this data carries no document boundaries (open_data(..., documents=True) finds them)")
        d = np.searchsorted(self.starts, np.arange(i * seq_len, i * seq_len + seq_len + 1), side="right")
        return d - d[0]


class Blend:
    """Megatron's weighted blend: sample k of an epoch comes from the part whose
    share so far falls furthest below its weight (deterministic), taking that
    part's next sample in its own permutation. An epoch has as many samples as
    lets every part supply its share without repeating."""

    def __init__(self, weights: list[float], parts: list[Tokens], names: list[str]):
        total = sum(weights)
        self.weights, self.parts, self.names = [w / total for w in weights], parts, names
        self._cache = {}

    def num_samples(self, seq_len: int) -> int:
        return int(min(p.num_samples(seq_len) / w for w, p in zip(self.weights, self.parts)))

    def _blending(self, n: int):
        """(part, index within the part) of each of n samples."""
        if n not in self._cache:
            w = np.asarray(self.weights)
            taken = np.zeros(len(w), dtype=np.int64)
            part, within = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
            for k in range(n):
                d = int(np.argmax(w * (k + 1) - taken))
                part[k], within[k] = d, taken[d]
                taken[d] += 1
            self._cache[n] = (part, within)
        return self._cache[n]

    def order(self, seq_len: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        n = self.num_samples(seq_len)
        part, within = self._blending(n)
        perms = [p.order(seq_len, seed * 1_000_003 + d, epoch, shuffle) for d, p in enumerate(self.parts)]
        return np.stack([part, np.array([perms[d][j] for d, j in zip(part, within)], dtype=np.int64)], axis=1)

    def sample(self, i, seq_len: int) -> np.ndarray:
        d, j = i
        return self.parts[int(d)].sample(int(j), seq_len)

    def documents(self, i, seq_len: int) -> np.ndarray:
        d, j = i
        return self.parts[int(d)].documents(int(j), seq_len)


def is_text(spec: str | None) -> bool:
    """Whether every source of a --data spec (one path or a blend) is text, read
    through a tokenizer, rather than token ids (a token file, a Megatron dataset)."""
    words = (spec or "").split()
    for source in words[1::2] if len(words) > 1 else [spec]:
        if source not in (None, "stdlib") and (exists(source) or (source.endswith(".bin") and exists(source[:-4]))
                                               or os.path.splitext(source)[1] in TOKEN_FILE_DTYPES):
            return False
    return True


def document_starts(source: str | None, tokens: np.ndarray, tokenizer: str | None = None) -> np.ndarray:
    """The offsets in `tokens` (one source's) at which its documents begin: a Megatron
    dataset's from its .idx, anything else's just after each end-of-text id (the
    tokenizer's; bytes' for text read as bytes; a token file needs its --tokenizer)."""
    if source not in (None, "stdlib") and (exists(source) or (source.endswith(".bin") and exists(source[:-4]))):
        ds = IndexedDataset(source if exists(source) else source[:-4])
        first = ds.documents[:-1]
        offsets = np.append(ds.pointers, len(ds.tokens) * ds.dtype.itemsize)[np.minimum(first, len(ds.pointers))]
        return offsets // ds.dtype.itemsize
    if source not in (None, "stdlib") and os.path.splitext(source)[1] in TOKEN_FILE_DTYPES and tokenizer is None:
        raise ValueError(f"--data {source} is a token file: its documents end at the end-of-text id, which only "
                         "its --tokenizer knows; give --tokenizer DIR (or use a Megatron dataset, whose .idx "
                         "lists the documents)")
    eot = load_tokenizer(tokenizer).eot if tokenizer else ByteTokenizer.eot
    ends = np.concatenate([np.flatnonzero(c == eot) + i for i, c in _chunks(tokens)] or [np.zeros(0, np.int64)])
    return np.concatenate([[0], ends + 1]).astype(np.int64)


def open_data(spec: str | None, vocab_size: int, tokenizer: str | None = None, documents: bool = False):
    """What the trainer's loader reads: Tokens of one source, or a Blend of
    "W1 PATH1 W2 PATH2 ..." (Megatron's --data-path). Every id is checked. With
    `documents`, each source also knows where its documents begin."""
    words = (spec or "").split()
    if len(words) > 1:
        if len(words) % 2:
            raise ValueError(f"--data {spec!r}: a blend is weight-path pairs, '0.7 PATH_A 0.3 PATH_B'")
        try:
            weights = [float(w) for w in words[0::2]]
        except ValueError:
            raise ValueError(f"--data {spec!r}: a blend is weight-path pairs, '0.7 PATH_A 0.3 PATH_B'") from None
        if any(w <= 0 for w in weights):
            raise ValueError(f"--data {spec!r}: blend weights must be positive")
        paths = words[1::2]
        return Blend(weights, [_tokens(p, vocab_size, tokenizer, documents) for p in paths], paths)
    return _tokens(spec, vocab_size, tokenizer, documents)


def _tokens(source: str | None, vocab_size: int, tokenizer: str | None, documents: bool) -> Tokens:
    tokens = load_tokens(source, vocab_size, tokenizer)
    return Tokens(tokens, document_starts(source, tokens, tokenizer) if documents else None)
