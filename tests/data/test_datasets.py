"""Real data: Hugging Face tokenizers built locally, Megatron's indexed datasets
(read and written byte for byte as Megatron-LM does), the prepare tool, and
weighted blends."""
import json
import os
import struct

import numpy as np
import pytest

from meshtron.data import (
    BatchLoader,
    IndexedDataset,
    IndexedDatasetWriter,
    Tokens,
    load_tokenizer,
    load_tokens,
    open_data,
)
from meshtron.data.prepare import prepare

from harness import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["def main():\n    return 42\n", "class A:\n    pass\n", "import os\nprint(os.getcwd())\n" * 3, "x = 1\n"]


def build_tokenizer(path, eos="<|endoftext|>"):
    """A tiny byte-level BPE trained here, saved as tokenizer.json (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=[eos],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def test_hf_tokenizer_encodes_decodes_and_finds_its_end_of_text(tmp_path):
    tok = load_tokenizer(build_tokenizer(str(tmp_path / "tok")))
    ids = tok.encode(TEXTS[0])
    assert tok.decode(ids) == TEXTS[0] and len(ids) < len(TEXTS[0].encode())
    assert tok.eot == tok.tok.token_to_id("<|endoftext|>")
    build_tokenizer(str(tmp_path / "noeos"), eos="<unk>")
    with pytest.raises(ValueError, match="no end-of-text token"):
        load_tokenizer(str(tmp_path / "noeos"))
    assert load_tokenizer(None).decode(load_tokenizer("bytes").encode("héllo")) == "héllo"


def megatron_builder(prefix, docs, dtype=np.int32):
    """Megatron-LM's IndexedDatasetBuilder, as its code writes: add_item per sequence,
    end_document after each document; then _IndexWriter.write."""
    codes = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
             np.uint16: 8}
    lengths, document_indices = [], [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in docs:
            for seq in doc:
                f.write(np.array(seq, dtype=dtype).tobytes(order="C"))
                lengths.append(len(seq))
            document_indices.append(len(lengths))
    pointers, cur = [], 0
    for n in lengths:
        pointers.append(cur)
        cur += n * np.dtype(dtype).itemsize
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", codes[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(document_indices, dtype=np.int64).tobytes(order="C"))


def test_reads_what_megatron_writes(tmp_path):
    docs = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10], [11], [12, 13]]]      # documents of several sequences
    for dtype in (np.int32, np.uint16):
        prefix = str(tmp_path / f"meg_{np.dtype(dtype).name}")
        megatron_builder(prefix, docs, dtype)
        ds = IndexedDataset(prefix)
        assert len(ds) == 3 and ds.dtype == np.dtype(dtype)
        assert [list(ds[i]) for i in range(3)] == [sum(d, []) for d in docs]
        assert list(ds.tokens) == list(range(1, 14))
        assert list(load_tokens(prefix, vocab_size=14)) == list(range(1, 14))


def test_writer_matches_megatron_byte_for_byte(tmp_path):
    docs = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    megatron_builder(str(tmp_path / "meg"), [[d] for d in docs], np.uint16)
    w = IndexedDatasetWriter(str(tmp_path / "ours"), vocab_size=100)
    for d in docs:
        w.add(d)
    w.close()
    for ext in (".bin", ".idx"):
        assert open(tmp_path / f"ours{ext}", "rb").read() == open(tmp_path / f"meg{ext}", "rb").read()


def test_bad_indexed_files_name_the_file(tmp_path):
    prefix = str(tmp_path / "d")
    megatron_builder(prefix, [[[1, 2]]])
    open(prefix + ".bin", "ab").write(b"\x00")
    with pytest.raises(ValueError, match=f"{prefix}.bin has 9 bytes; its index {prefix}.idx describes 2 tokens"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "r+b").write(b"NOTMEGA")
    with pytest.raises(ValueError, match=f"{prefix}.idx is not a Megatron indexed-dataset index"):
        IndexedDataset(prefix)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=f"no {prefix}.bin"):
        IndexedDataset(prefix)


def test_prepare_round_trips_document_by_document(tmp_path):
    tok_dir = build_tokenizer(str(tmp_path / "tok"))
    tok = load_tokenizer(tok_dir)
    for i, t in enumerate(TEXTS[:2]):
        (tmp_path / f"doc{i}.txt").write_text(t)
    with open(tmp_path / "more.jsonl", "w") as f:
        for t in TEXTS[2:]:
            f.write(json.dumps({"text": t, "id": 0}) + "\n")
    inputs = [str(tmp_path / "doc0.txt"), str(tmp_path / "doc1.txt"), str(tmp_path / "more.jsonl")]
    out = run_script(["-m", "meshtron.data.prepare", *inputs, "--output-prefix", str(tmp_path / "out" / "corpus"),
                      "--tokenizer", tok_dir, "--workers", "2"], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "4 documents" in out.stderr and "\r" not in out.stderr   # a log gets whole lines
    ds = IndexedDataset(str(tmp_path / "out" / "corpus"))
    assert [list(ds[i]) for i in range(len(ds))] == [tok.encode(t) + [tok.eot] for t in TEXTS]


def test_prepare_reads_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    tok_dir = build_tokenizer(str(tmp_path / "tok"))
    tok = load_tokenizer(tok_dir)
    pq.write_table(pa.table({"text": TEXTS}), str(tmp_path / "c.parquet"))
    prepare([str(tmp_path / "c.parquet")], str(tmp_path / "pq"), tok_dir, progress=None)
    assert [list(d) for d in IndexedDataset(str(tmp_path / "pq"))] == [tok.encode(t) + [tok.eot] for t in TEXTS]


def test_prepare_errors_name_the_input(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a JSON object with a 'text' field"):
        prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "o"), progress=None)
    with pytest.raises(FileNotFoundError, match="no file or directory at .*missing.txt"):
        prepare([str(tmp_path / "missing.txt")], str(tmp_path / "o"), progress=None)


def test_the_tokenizer_trainer_and_prepare_read_a_directory_as_data_does(tmp_path):
    # issue 57, point 6: a directory is every file under it (one not UTF-8 among them, as a
    # __pycache__ holds), the documents --data DIR reads; the trainer prints one line, an error is one line
    pytest.importorskip("tokenizers")
    corpus, tok_dir = tmp_path / "corpus", str(tmp_path / "tok")
    (corpus / "sub").mkdir(parents=True)
    for i, t in enumerate(TEXTS):
        (corpus / ("sub" if i % 2 else "") / f"d{i}.txt").write_text(t)
    (corpus / "sub" / "d.pyc").write_bytes(b"\xa7\r\r\n\x00\xff")
    out = run_script(["-m", "meshtron.data.train_tokenizer", str(corpus), "--vocab-size", "300", "--out", tok_dir])
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1, (out.stdout, out.stderr)
    assert out.stdout.startswith(f"{tok_dir}/tokenizer.json: ") and out.stdout.endswith(" tokens, end of text 0\n")
    out = run_script(["-m", "meshtron.data.prepare", str(corpus), "--output-prefix", str(tmp_path / "c"),
                      "--tokenizer", tok_dir])
    assert out.returncode == 0, out.stderr
    ds = IndexedDataset(str(tmp_path / "c"))
    assert len(ds) == 5 and np.concatenate([ds[i] for i in range(5)]).tolist() == \
        load_tokens(str(corpus), tokenizer=tok_dir).tolist()
    out = run_script(["-m", "meshtron.data.train_tokenizer", str(tmp_path / "none"), "--out", tok_dir])
    assert out.returncode == 1 and out.stderr == f"error: no file or directory at {tmp_path}/none\n", out.stderr


def test_a_blend_serves_each_part_by_its_weight(tmp_path):
    a, b = np.full(10_000, 1, dtype=np.uint16), np.full(30_000, 2, dtype=np.uint16)
    np.asarray(a).tofile(tmp_path / "a.u16")
    np.asarray(b).tofile(tmp_path / "b.u16")
    blend = open_data(f"0.7 {tmp_path / 'a.u16'} 0.3 {tmp_path / 'b.u16'}", vocab_size=10)
    loader = BatchLoader(blend, seq_len=9, global_batch=100, seed=3)
    counts = np.zeros(3)
    for _ in range(5):
        x, _ = loader.next()
        counts += np.bincount(x[:, 0].numpy(), minlength=3)
        share = counts[1] / counts[1:].sum()
        assert abs(share - 0.7) <= 0.01, share           # within 1 sample in 100, batch after batch
    again = BatchLoader(open_data(f"0.7 {tmp_path / 'a.u16'} 0.3 {tmp_path / 'b.u16'}", 10), 9, 100, seed=3)
    assert all((again.next()[0] == BatchLoader(blend, 9, 100, seed=3, step=i).next()[0]).all() for i in range(2))
    with pytest.raises(ValueError, match="a blend is weight-path pairs"):
        open_data(f"0.7 {tmp_path / 'a.u16'} 0.3", 10)
    with pytest.raises(ValueError, match="token id 2 .* vocabulary size 2"):
        open_data(f"0.5 {tmp_path / 'a.u16'} 0.5 {tmp_path / 'b.u16'}", 2)


def test_text_through_a_tokenizer(tmp_path):
    tok_dir = build_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "t.txt").write_text(TEXTS[0])
    tok = load_tokenizer(tok_dir)
    assert list(load_tokens(str(tmp_path / "t.txt"), 1000, tok_dir)) == tok.encode(TEXTS[0]) + [tok.eot]
    assert isinstance(open_data(None, 320), Tokens)
    top = max(tok.encode(TEXTS[0]) + [tok.eot])       # a model smaller than the tokenizer: say which size fits
    with pytest.raises(ValueError, match=f"vocabulary size {top}; --tokenizer {tok_dir} has {tok.vocab_size} tokens: "
                                         f"pass --vocab-size {tok.vocab_size}$"):
        load_tokens(str(tmp_path / "t.txt"), top, tok_dir)
