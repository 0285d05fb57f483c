"""Layout checks every decoder-only transformer shares; each model's spec calls
them with its own sizes, so meshtron.distributed knows no model's fields. Pure
arithmetic: every rank raises the same ValueError before anything communicates."""
from __future__ import annotations


def check_decoder_layout(degrees: dict[str, int], parallel, seq_len: int, *, n_layers: int, max_seq_len: int,
                         heads: int, tp_divides: dict[str, int], n_experts: int = 0, kv_heads: int | None = None,
                         attention_dropout: float = 0.0) -> None:
    """`tp_divides`: what else tp must split, {"the hidden size": dim, ...}."""
    tp, pp, cp, ep = degrees["tp"], degrees["pp"], degrees["cp"], degrees["ep"]
    if heads % tp:
        raise ValueError(f"tp={tp} does not divide the number of attention heads {heads}")
    for what, n in tp_divides.items():
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what} {n}" + (" (pad it)" if "vocabulary" in what else ""))
    if pp > n_layers:
        raise ValueError(f"pp={pp} is greater than the number of layers {n_layers}")
    if seq_len > max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len {max_seq_len}")
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"cp={cp} needs the sequence length {seq_len} to be divisible by 2*cp={2 * cp}")
    if parallel.sp and (seq_len // cp) % tp:
        where = f"--seq-len {seq_len}" if cp == 1 else f"each cp rank's {seq_len // cp} tokens"
        raise ValueError(f"sequence parallelism splits the sequence over tp={tp} ranks: {where} must be "
                         f"divisible by {tp}")
    if cp > 1 and parallel.cp_comm == "a2a":
        for what, n in (("attention heads", heads // tp), ("KV heads", (kv_heads or heads) // tp)):
            if n % cp:
                raise ValueError(f"--cp-comm a2a splits each tp rank's {n} {what} over cp={cp}: it must divide "
                                 "them (or use p2p or allgather)")
    if n_experts and parallel.recompute == "selective":
        raise ValueError("--recompute selective with mixture-of-experts blocks is not supported yet (the experts' "
                         "own FSDP unit runs inside the recomputed region): use --recompute full or none")
    if cp > 1 and attention_dropout > 0:
        raise ValueError("context parallelism computes attention without dropout: set the model's dropout to 0")
    if parallel.moe_two_batch and not n_experts:
        raise ValueError("--moe-two-batch overlaps the all-to-alls of mixture-of-experts blocks: this model has "
                         "none")
    if ep > 1 and (n_experts == 0 or n_experts % ep):
        raise ValueError(f"ep={ep} needs a mixture-of-experts model whose expert count it divides "
                         f"(this model has {n_experts} experts)")


def head_cost(cfg) -> float:
    """The output head's matmul work in layers: vocab x dim weights against a layer's
    (active) matmul weights, from the model's own FLOP count. The embedding's lookup
    costs next to nothing and weighs 0. A pipeline balanced on these costs keeps
    the last stage from waiting on a head as large as several layers (the GPT 1.3B's
    is two, llama-1B's four)."""
    head = cfg.vocab_size * cfg.dim
    per_layer = (cfg.flops_per_token(0) / 6 - head) / cfg.n_layers
    return head / per_layer
