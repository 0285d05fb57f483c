"""Tokenize a corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).

    python -m meshtron.data.prepare docs/*.txt corpus.jsonl --output-prefix data/corpus \\
        --tokenizer tokenizer/ --workers 4

Inputs: text files (each a document), JSON lines (the --text-field of each line a
document) and parquet (its --text-field column; needs pyarrow); a directory is
every file under it, as `--data DIR` reads it. Documents keep
their boundaries (one indexed-dataset document each, the end-of-text id
appended); workers tokenize in parallel, the output keeps the input order.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

from meshtron.data.indexed import IndexedDatasetWriter
from meshtron.data.sources import text_files
from meshtron.data.tokenizer import load_tokenizer


def documents(paths: list[str], field: str):
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)[field]
                        except (ValueError, KeyError):
                            raise ValueError(f"{path}:{n}: not a JSON object with a {field!r} field") from None
        elif path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ValueError(f"{path}: parquet needs pyarrow (pip install pyarrow)") from None
            for batch in pq.ParquetFile(path).iter_batches(columns=[field]):
                yield from batch.column(field).to_pylist()
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


_tok = None


def _init(spec):
    global _tok
    _tok = load_tokenizer(spec)


def _encode(args):
    text, eot = args
    return _tok.encode(text) + ([_tok.eot] if eot else [])


def prepare(paths: list[str], prefix: str, tokenizer: str | None = None, workers: int = 1, field: str = "text",
            eot: bool = True, progress=True) -> tuple[int, int]:
    """Write PREFIX.bin/.idx; returns (documents, tokens). A directory in `paths` stands
    for every file under it, as --data reads it. progress: a stream, True for the
    sys.stderr of the moment, or None for none."""
    progress = sys.stderr if progress is True else progress
    paths = [f for path in paths for f in text_files(path)]
    tok = load_tokenizer(tokenizer)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    writer = IndexedDatasetWriter(prefix, tok.vocab_size)
    n_docs = n_tokens = 0
    t0 = last = time.monotonic()
    # a terminal gets one line rewritten each second; a log (a file, a pipe) a whole line each 10 s
    tty = bool(progress) and progress.isatty()
    cr, every = ("\r", 1) if tty else ("", 10)
    jobs = ((text, eot) for text in documents(paths, field))
    pool = mp.get_context("spawn").Pool(workers, _init, (tokenizer,)) if workers > 1 else None
    try:
        if pool is None:
            _init(tokenizer)
        for ids in (pool.imap(_encode, jobs, chunksize=16) if pool else map(_encode, jobs)):
            writer.add(ids)
            n_docs, n_tokens = n_docs + 1, n_tokens + len(ids)
            if progress and time.monotonic() - last > every:
                last = time.monotonic()
                print(f"{cr}{n_docs:,} documents, {n_tokens:,} tokens, {n_tokens / (last - t0):,.0f} tokens/s",
                      end="" if tty else "\n", file=progress, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        writer.close()
    if progress:
        print(f"{cr}{n_docs:,} documents, {n_tokens:,} tokens -> {prefix}.bin, {prefix}.idx "
              f"({time.monotonic() - t0:.1f} s)", file=progress, flush=True)
    return n_docs, n_tokens


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text files, .jsonl files, .parquet files, or directories (every "
                   "file under them)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json directory, or 'bytes' (default)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--text-field", default="text", help="the text of a JSON line or parquet row")
    p.add_argument("--append-eot", action=argparse.BooleanOptionalAction, default=True,
                   help="end each document with the end-of-text id")
    args = p.parse_args(argv)
    try:
        prepare(args.inputs, args.output_prefix, args.tokenizer, args.workers, args.text_field, args.append_eot)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
