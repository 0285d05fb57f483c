"""Megatron-LM's indexed dataset, read and written byte for byte as its
megatron/core/datasets/indexed_dataset.py defines it:

    PREFIX.bin  the token ids of every document, back to back
    PREFIX.idx  b"MMIDIDX\\x00\\x00", version <Q 1, dtype code <B (1 uint8, 2 int8,
                3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16),
                <Q sequence count, <Q document count, then int32 sequence lengths,
                int64 sequence byte offsets, int64 document indices (0, then the
                sequence count after each document)

Both files are memory-mapped: nothing is read until used.
"""
from __future__ import annotations

import os
import struct

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")


class IndexedDataset:
    """Documents of token ids: len(), [i] -> a document, .tokens (all of them, one memmap)."""

    def __init__(self, prefix: str):
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        for f in (idx, bin_):
            if not os.path.isfile(f):
                raise FileNotFoundError(f"indexed dataset {prefix}: no {f}")
        with open(idx, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != HEADER:
            raise ValueError(f"{idx} is not a Megatron indexed-dataset index (bad header)")
        version, code, n_seq, n_doc = struct.unpack("<Q", head[9:17])[0], head[17], *struct.unpack("<QQ", head[18:34])
        if version != 1:
            raise ValueError(f"{idx} has version {version}; only version 1 is known")
        if code not in DTYPES:
            raise ValueError(f"{idx} has an unknown dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        index = np.memmap(idx, mode="r", dtype=np.uint8)
        self.lengths = np.frombuffer(index, dtype=np.int32, count=n_seq, offset=34)
        self.pointers = np.frombuffer(index, dtype=np.int64, count=n_seq, offset=34 + 4 * n_seq)
        self.documents = np.frombuffer(index, dtype=np.int64, count=n_doc, offset=34 + 12 * n_seq)
        n_tokens = int(self.lengths.sum(dtype=np.int64))
        if os.path.getsize(bin_) != n_tokens * self.dtype.itemsize:
            raise ValueError(f"{bin_} has {os.path.getsize(bin_)} bytes; its index {idx} describes "
                             f"{n_tokens} tokens of {self.dtype.itemsize} bytes")
        self.tokens = np.memmap(bin_, mode="r", dtype=self.dtype) if n_tokens else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.documents) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        first, last = int(self.documents[i]), int(self.documents[i + 1])
        start = int(self.pointers[first]) // self.dtype.itemsize if first < len(self.lengths) else len(self.tokens)
        return self.tokens[start:start + int(self.lengths[first:last].sum())]


class IndexedDatasetWriter:
    """Add documents, then close(): PREFIX.bin and PREFIX.idx. uint16 when the
    vocabulary fits (< 65500 ids, as Megatron decides), else int32."""

    def __init__(self, prefix: str, vocab_size: int | None):
        self.prefix = prefix
        self.dtype = np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)
        self.bin = open(prefix + ".bin", "wb")
        self.lengths: list[int] = []
        self.documents = [0]

    def add(self, ids) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        self.bin.write(arr.tobytes(order="C"))
        self.lengths.append(len(arr))
        self.documents.append(len(self.lengths))

    def close(self) -> None:
        self.bin.close()
        pointers = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)[:-1]]) * self.dtype.itemsize \
            if self.lengths else np.zeros(0, np.int64)
        with open(self.prefix + ".idx", "wb") as f:
            f.write(HEADER + struct.pack("<Q", 1) + struct.pack("<B", CODES[self.dtype]))
            f.write(struct.pack("<Q", len(self.lengths)) + struct.pack("<Q", len(self.documents)))
            f.write(np.asarray(self.lengths, dtype=np.int32).tobytes(order="C"))
            f.write(np.asarray(pointers, dtype=np.int64).tobytes(order="C"))
            f.write(np.asarray(self.documents, dtype=np.int64).tobytes(order="C"))
