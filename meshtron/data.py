"""Token data: a byte-level tokenizer, sources, fixed-length packing, and a
deterministic sampler that gives each data-parallel rank its own disjoint part
of every global batch.

Sources
- default: the Python standard library's own *.py files (real text that ships
  with every Python; no download),
- a text file or a directory of text files (read as UTF-8 bytes),
- pre-tokenised token files: raw little-endian uint16 (`.u16` / `.bin`) or
  uint32 (`.u32`) arrays, memory-mapped, documents separated by the EOT id.

The loader's whole state is one integer, the number of global batches already
served, so a checkpoint can store it and resume exactly.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 is end-of-text. Needs no files."""

    eot = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def _documents_to_tokens(docs: list[bytes], eot: int) -> np.ndarray:
    parts = []
    for d in docs:
        parts.append(np.frombuffer(d, dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def stdlib_tokens(max_bytes: int = 8 << 20) -> np.ndarray:
    """The standard library's sources in sorted path order, up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in path or "test" in os.path.relpath(path, root).split(os.sep)[0]:
            continue
        with open(path, "rb") as f:
            data = f.read()
        docs.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return _documents_to_tokens(docs, ByteTokenizer.eot)


def text_tokens(path: str) -> np.ndarray:
    """A text file, or every file under a directory (sorted), as byte tokens."""
    if os.path.isdir(path):
        files = sorted(p for p in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(p))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"no text file or directory at {path}")
    docs = []
    for p in files:
        with open(p, "rb") as f:
            docs.append(f.read())
    return _documents_to_tokens(docs, ByteTokenizer.eot)


TOKEN_FILE_DTYPES = {".u16": np.uint16, ".bin": np.uint16, ".u32": np.uint32}


def token_file(path: str) -> np.ndarray:
    """A pre-tokenised file, memory-mapped (nothing is read until used)."""
    ext = os.path.splitext(path)[1]
    if ext not in TOKEN_FILE_DTYPES:
        raise ValueError(f"token file {path} must end in one of {list(TOKEN_FILE_DTYPES)} (uint16 or uint32)")
    return np.memmap(path, dtype=TOKEN_FILE_DTYPES[ext], mode="r")


def write_token_file(path: str, tokens) -> None:
    np.asarray(tokens, dtype=TOKEN_FILE_DTYPES[os.path.splitext(path)[1]]).tofile(path)


def load_tokens(source: str | None) -> np.ndarray:
    if source is None or source == "stdlib":
        return stdlib_tokens()
    if os.path.splitext(source)[1] in TOKEN_FILE_DTYPES:
        return token_file(source)
    return text_tokens(source)


@dataclass
class BatchLoader:
    """Packs tokens into samples of seq_len+1 and serves global batches.

    Sample i is tokens[i*T : i*T + T + 1] (inputs and shifted targets). Each
    epoch visits the samples in a permutation drawn from (seed, epoch). Global
    batch `step` takes the next `global_batch` samples; the data-parallel rank
    r of n takes its contiguous slice of global_batch/n, cut into micro-batches.
    """

    tokens: np.ndarray
    seq_len: int
    global_batch: int
    dp_rank: int = 0
    dp_size: int = 1
    micro_batch: int | None = None
    seed: int = 0
    step: int = 0

    def __post_init__(self):
        if self.global_batch % self.dp_size:
            raise ValueError(f"global batch {self.global_batch} is not divisible by the data-parallel size {self.dp_size}")
        self.local_batch = self.global_batch // self.dp_size
        self.micro_batch = self.micro_batch or self.local_batch
        if self.local_batch % self.micro_batch:
            raise ValueError(f"local batch {self.local_batch} (= global {self.global_batch} / dp {self.dp_size}) "
                             f"is not divisible by the micro-batch {self.micro_batch}")
        self.n_samples = (len(self.tokens) - 1) // self.seq_len
        if self.n_samples < self.global_batch:
            raise ValueError(f"{len(self.tokens)} tokens make {self.n_samples} samples of length {self.seq_len}, "
                             f"fewer than one global batch of {self.global_batch}")
        self.batches_per_epoch = self.n_samples // self.global_batch
        self._perm_epoch, self._perm = -1, None

    def _sample_ids(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.batches_per_epoch)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_epoch, self._perm = epoch, rng.permutation(self.n_samples)
        ids = self._perm[i * self.global_batch:(i + 1) * self.global_batch]
        return ids[self.dp_rank * self.local_batch:(self.dp_rank + 1) * self.local_batch]

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the next global batch: [(x, y)], each (mb, T)."""
        ids = self._sample_ids(self.step)
        self.step += 1
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * T:i * T + T + 1], dtype=np.int64) for i in ids])
        xy = torch.from_numpy(rows)
        return [(mb[:, :-1], mb[:, 1:]) for mb in xy.split(self.micro_batch)]

    def state_dict(self) -> dict:
        return {"step": self.step, "global_batch": self.global_batch, "seq_len": self.seq_len, "seed": self.seed}

    def load_state_dict(self, sd: dict, rebatch_by_tokens: bool = False) -> None:
        """Resume exactly: the position is in global batches, so any data-parallel
        degree continues with the same samples. A different global batch or sequence
        length cannot continue the same sample order; with rebatch_by_tokens the run
        goes on at the same token count, sample order recomputed for the new batch."""
        if sd["seed"] != self.seed:
            raise ValueError(f"data loader state has seed={sd['seed']}, this run uses {self.seed}")
        if (sd["global_batch"], sd["seq_len"]) != (self.global_batch, self.seq_len):
            if not rebatch_by_tokens:
                raise ValueError(
                    f"the checkpoint's data position is {sd['step']} batches of {sd['global_batch']} x {sd['seq_len']} "
                    f"tokens; this run uses {self.global_batch} x {self.seq_len}, which cannot continue the same "
                    "sample order. Keep the global batch and sequence length, or pass --data-rebatch to go on "
                    "at the same token count")
            self.step = sd["step"] * sd["global_batch"] * sd["seq_len"] // (self.global_batch * self.seq_len)
            return
        self.step = sd["step"]
