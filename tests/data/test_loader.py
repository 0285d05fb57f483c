import numpy as np
import pytest
import torch

from meshtron.data import (
    BatchLoader,
    ByteTokenizer,
    load_tokens,
    stdlib_tokens,
    text_tokens,
    token_file,
    write_token_file,
)


def test_stdlib_default_data_is_real_text():
    tokens = stdlib_tokens(max_bytes=1 << 20)
    assert len(tokens) > 1 << 20
    assert tokens.max() == ByteTokenizer.eot and (tokens == ByteTokenizer.eot).sum() > 10
    text = ByteTokenizer().decode(tokens[:20000])
    assert "def " in text and "import" in text


def test_dp_ranks_read_disjoint_shards_that_cover_the_global_batch():
    tokens = stdlib_tokens(max_bytes=1 << 20)
    full = BatchLoader(tokens, seq_len=32, global_batch=8, seed=1, micro_batch=4)
    ranks = [BatchLoader(tokens, seq_len=32, global_batch=8, dp_rank=r, dp_size=4, micro_batch=1, seed=1)
             for r in range(4)]
    for _ in range(3):
        x, y = full.next()
        parts = [r.next() for r in ranks]
        assert all(p[0].shape == (2, 32) for p in parts)          # 2 samples per rank
        # micro-batch i of every rank together is one process's micro-batch i (4 samples of the
        # same global micro-batch), in the same order
        for i in range(2):
            assert torch.equal(torch.cat([p[0][i:i + 1] for p in parts]), x[4 * i:4 * i + 4])
            assert torch.equal(torch.cat([p[1][i:i + 1] for p in parts]), y[4 * i:4 * i + 4])
        assert torch.equal(x[:, 1:], y[:, :-1])                   # targets are the shifted inputs
    # deterministic from the seed, different for another seed
    a = BatchLoader(tokens, 32, 8, seed=1).next()[0]
    b = BatchLoader(tokens, 32, 8, seed=2).next()[0]
    assert torch.equal(a, BatchLoader(tokens, 32, 8, seed=1).next()[0]) and not torch.equal(a, b)


def test_loader_state_resumes_exactly_and_wraps_epochs():
    tokens = np.arange(1000, dtype=np.uint16) % 257
    a = BatchLoader(tokens, seq_len=9, global_batch=4, seed=0)   # 110 samples, 27 batches an epoch
    for _ in range(40):
        a.next()
    b = BatchLoader(tokens, seq_len=9, global_batch=4, seed=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next()[0], b.next()[0])
    with pytest.raises(ValueError, match="pass --global-batch 4 to continue it, or --data-rebatch"):
        BatchLoader(tokens, seq_len=9, global_batch=8).load_state_dict(a.state_dict())
    c = BatchLoader(tokens, seq_len=9, global_batch=8)
    c.load_state_dict(a.state_dict(), rebatch_by_tokens=True)
    assert c.step == a.step * 4 // 8


def test_no_shuffle_reads_the_file_in_order_every_epoch():
    tokens = np.arange(1000, dtype=np.uint16)
    a = BatchLoader(tokens, seq_len=9, global_batch=4, dp_rank=1, dp_size=2, shuffle=False)   # 27 batches an epoch
    x, y = a.next()
    assert x[:, 0].tolist() == [18, 27] and torch.equal(x[:, 1:], y[:, :-1])   # samples 2 and 3 of batch 0
    for _ in range(26):
        a.next()
    assert a.next()[0][:, 0].tolist() == [18, 27]                                # epoch 2 starts over
    # in micro-batches of 1: this rank's share of each global micro-batch of 2, samples 1 and 3
    assert BatchLoader(tokens, 9, 4, dp_rank=1, dp_size=2, micro_batch=1, shuffle=False).next()[0][:, 0].tolist() \
        == [9, 27]


def test_bad_batch_shapes_are_clear_errors():
    tokens = np.zeros(1000, dtype=np.uint16)
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 3"):
        BatchLoader(tokens, 8, global_batch=8, dp_size=3)
    with pytest.raises(ValueError, match="not divisible by the micro-batch 3"):
        BatchLoader(tokens, 8, global_batch=8, dp_size=2, micro_batch=3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchLoader(tokens, 500, global_batch=8)


def test_user_text_and_token_files(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("héllo")
    (tmp_path / "docs" / "b.txt").write_text("world")
    toks = text_tokens(str(tmp_path / "docs"))
    assert ByteTokenizer().decode(toks) == "hélloworld" and (toks == 256).sum() == 2
    for ext, dtype in ((".u16", np.uint16), (".u32", np.uint32)):
        path = str(tmp_path / f"corpus{ext}")
        data = np.arange(70000) % (65535 if dtype == np.uint16 else 100000)
        write_token_file(path, data)
        mm = load_tokens(path)
        assert isinstance(mm, np.memmap) and mm.dtype == dtype and np.array_equal(mm, data)
    with pytest.raises(ValueError, match="must end in one of"):
        token_file(str(tmp_path / "x.npy"))
    with pytest.raises(FileNotFoundError):
        load_tokens(str(tmp_path / "missing"))
