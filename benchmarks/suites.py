"""The suites: named rows, each a command the runner runs and the figures it reads back.

A row is meshtron's step under a layout (benchmarks/bench_train.py, the recipe's own
Trainer), a peer (torchtitan 0.2.2 through benchmarks/peers/torchtitan/run.sh), or a
tool's measurement (bench_kernels.py, bench_cp.py, ...; one tool run may give several
rows). A row names the row it is compared with: a peer's, or another meshtron row's
where the peer has no such layout. Imports no torch: `list` and `report` run anywhere.
"""
from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

PY = "python"                        # replaced by the runner's own interpreter
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
DATA = "{assets}/c4_idx/c4_test"     # the kit's c4_test as a Megatron dataset (the documents suite's set-up)


@dataclass
class Job:
    name: str                        # the row, or the tool run that yields `rows`
    gpus: int
    kind: str = "meshtron"           # meshtron | peer | tool
    layout: str = ""                 # meshtron: a bench_train LAYOUTS name; peer: a run.sh variant
    flags: list = field(default_factory=list)   # meshtron: recipe flags; tool: its argv ({out}: its folder)
    peer: str | None = None          # the row this one is compared with
    env: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)    # tool: the rows it yields (default: its name)
    read: Callable | None = None     # tool: (job, its folder) -> {row: (figures, peer, ratio)}

    def row_names(self) -> list[str]:
        return self.rows or [self.name]


@dataclass
class Suite:
    about: str                       # what it measures, one or two sentences for RESULTS.md
    jobs: list
    setup: list = field(default_factory=list)   # argv run once before the jobs, unless `creates` exists
    creates: str = ""


def mt(name, gpus, layout, flags, peer=None, **env):
    return Job(name, gpus, "meshtron", layout, list(flags), peer, env)


def tt(name, gpus, variant, **env):
    return Job(name, gpus, "peer", variant, [], None, env)


def tool(name, gpus, argv, read, rows=(), peer=None, launch="torchrun", **env):
    """A tool's run: under torchrun (`launch`), one process ("python") or "bash"."""
    cmd = {"torchrun": TORCHRUN + [str(gpus)], "python": [PY], "bash": ["bash"]}[launch] + list(argv)
    return Job(name, gpus, "tool", "", cmd, peer, env, list(rows), read)


def tt_batch(n: int, more: str = "") -> dict:
    """The peer's sequences per data-parallel rank (TT3_ARGS, read by run.sh)."""
    return {"TT3_ARGS": f"--training.local_batch_size {n}" + (f" {more}" if more else "")}


def l1b(global_batch: int, *more, micro_batch: int = 16, model: str = "llama-1B") -> list[str]:
    """llama-1B (untied, as torchtitan's), 16 x 2048 a model replica, global batch `global_batch`."""
    return ["--model", model, "--untie-embeddings", "--seq-len", "2048", "--micro-batch", str(micro_batch),
            "--global-batch", str(global_batch), *more]


def l3b(global_batch: int, *more, micro_batch: int = 8) -> list[str]:
    return l1b(global_batch, *more, micro_batch=micro_batch, model="llama-3B")


def l617m(seq: int, *more) -> list[str]:
    """llama-617M (8 x 2048, torchtitan's cp_8l shape), one sequence of `seq` tokens a step."""
    return ["--model", "llama-617M", "--seq-len", str(seq), "--micro-batch", "1", "--global-batch", "1", *more]


def gpt(model: str, micro_batch: int, global_batch: int, *more) -> list[str]:
    return ["--model", model, "--seq-len", "2048", "--micro-batch", str(micro_batch),
            "--global-batch", str(global_batch), *more]


TT16 = tt_batch(16)
MOE = ["--model", "llama-moe-3B", "--seq-len", "2048", "--micro-batch", "4"]
GPT8 = gpt("1.3B", 8, 8)
PIPE = l1b(32, micro_batch=4)   # the pipeline rows: global batch 32, micro-batch 4
STEPS5 = ["--profile-steps", "5"]   # a bubble is the median of five profiled steps' (bench_train.step_idle)
L8B = ["--model", "llama-8B", "--seq-len", "2048"]
L8B_8K = ["--model", "llama-8B", "--seq-len", "8192", "--micro-batch", "1", "--global-batch", "4"]
S8K = "--training.seq_len 8192"
TT_MOE_LOAD = "--experimental.custom_import tt3_moe_load"   # torchtitan's routing load (py/tt3_moe_load.py)


# ---------------------------------------------------------------- tools' readers

def lines(path: str) -> list[dict]:
    return [json.loads(x) for x in open(path) if x.strip()] if os.path.exists(path) else []


def read_kernels(job: Job, out: str) -> dict:
    rows = {}
    for r in lines(os.path.join(out, "kernels.jsonl")):
        peers = {k: r[k] for k in ("eager", "compile", "liger") if r.get(k)}
        rows[f"{r['op']} {r['shape']} {r['dir']}"] = (
            {"gb_s": r["meshtron"], **{f"{k}_gb_s": v for k, v in peers.items()}}, "best peer",
            r["meshtron"] / max(peers.values()) if peers else None)
    return rows


def kernel_rows() -> list[str]:
    return ([f"LayerNorm 16384x{n} {d}" for n in (1024, 4096, 8192) for d in ("fwd", "bwd")]
            + [f"bias-GeLU 16384x16384 {d}" for d in ("fwd", "bwd")]
            + [f"{op} 32768x{n} ({m}) {d}" for op, shapes in (("RMSNorm", ((2048, "1B"), (4096, "8B"))),
                                                              ("SwiGLU", ((8192, "1B"), (14336, "8B"))))
               for n, m in shapes for d in ("fwd", "bwd", "fwd+bwd")])


def read_cp(job: Job, out: str) -> dict:
    rows = {}
    for r in lines(os.path.join(out, "results.jsonl")):
        k = f"{r['seq'] // 1024}K"
        if r["mode"] == "simulate":
            rows[f"{k}, cp{r['cp']} simulated, {r['variant']}"] = (
                {"of_ideal": r["compute_of_ideal"], "balance": r["balance"]}, None, None)
        else:
            figs = {f"{v}_ms": r.get(f"{v}_ms") for v in ("whole", "ideal", "p2p", "allgather", "a2a",
                                                         "torch_cp_allgather", "torch_cp_alltoall")}
            peer = r.get("torch_cp_alltoall_ms")
            rows[f"{k}, cp{r['cp']}"] = ({k2: v for k2, v in figs.items() if v}, "torch's context_parallel (ring)",
                                         peer / r["p2p_ms"] if peer else None)
    return rows


def read_moe(job: Job, out: str) -> dict:
    rows = {}
    for r in lines(os.path.join(out, "moe.jsonl")):
        name = f"{r['experts']} experts" if r["kind"] == "experts" else "one MoE layer, top-2 of 16"
        key = f"at_{r['tokens']}" if r["kind"] == "experts" else f"layer_{r['tokens']}"
        rows.setdefault(name, ({}, None, None))[0][key] = r["dense_over_moe_gpu"]
    return rows


def read_documents(job: Job, out: str) -> dict:
    """bench_documents.py: --train's one row (the job's), or --attention's rows."""
    rows = {}
    for r in lines(os.path.join(out, "documents.jsonl")):
        rows[job.name] = ({"tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "step_ms": r["step_ms"], "mfu": r["mfu"],
                     "peak_gib": r["peak_mem_gib"], "reserved_gib": r["peak_reserved_gib"],
                     "kept": r["kept_causal_share"]}, None, None)
    for r in lines(os.path.join(out, "attention.jsonl")):
        if "ms" in r:
            rows[f"{r['case']}: {r['variant']}"] = ({"ms": r["ms"], "tflops": r["tflops_kept"]}, None, None)
    return rows


def read_fused_loss(job: Job, out: str) -> dict:
    path = os.path.join(out, "fused_loss.json")
    results = json.load(open(path))["results"] if os.path.exists(path) else []
    by = {r["name"]: r for r in results if "ms" in r}
    base = by.get("plain_compile", {}).get("ms")
    names = {"plain_eager": "unfused eager", "plain_compile": "unfused, compiled"}
    rows = {}
    for key, r in by.items():
        chunk = key.rsplit("_c", 1)[-1]
        name = names.get(key) or (f"fused {'eager' if '_eager_' in key else 'compiled'}, chunk {chunk}")
        rows[name] = ({"ms": r["ms"], "peak_gib": r["peak_gib"], "dw_rel": r.get("dw_rel")},
                      "unfused, compiled", base / r["ms"] if base and key != "plain_compile" else None)
    return rows


def read_checkpoint(job: Job, out: str) -> dict:
    by = {r["mode"]: r for r in lines(os.path.join(out, "checkpoint.jsonl"))}
    rows = {}
    for mode, r in by.items():
        holds = r["hold_ms"]
        figs = {"step_ms": r["step_ms_idle"], "in_flight_ms": r["step_ms_in_flight"], "hold_ms": holds[0],
                "hold_later_ms": statistics.median(holds[1:]) if holds[1:] else None}
        if mode == "async":
            figs["write_s"] = max(r["write_s"])
        sync = by.get("sync")
        ratio = sync["hold_ms_median"] / r["hold_ms_median"] if mode == "async" and sync else None
        rows[f"{job.name}, {NAMES[mode]}"] = ({k: v for k, v in figs.items() if v is not None},
                                             f"{job.name}, {NAMES['sync']}" if ratio else None, ratio)
    return rows


NAMES = {"sync": "blocking saves", "async": "async saves"}


def read_ce(job: Job, out: str) -> dict:
    path = os.path.join(out, "ce_collectives.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    return {r["collective"]: ({"ms": r["ms_alone"], "beside_ms": r["ms_beside_matmul"],
                               "matmul_slowdown_ms": r["matmul_slowdown_ms"]}, None, None)
            for r in rows if "error" not in r}


def read_balance(job: Job, out: str) -> dict:
    rows = {}
    for r in lines(os.path.join(out, "balance.jsonl")):
        rows[job.name] = ({"load": max(r["last"]), "load_last10": max(r["last10_mean"]),
                     "router_load": max(r["own_last10_mean"]), "loss": r["final_loss"]}, None, None)
    return rows


def read_plan(job: Job, out: str) -> dict:
    ok = [r for r in lines(os.path.join(out, "plan.jsonl")) if "step_error" in r]
    if not ok:
        return {}
    return {job.name: ({"step_error": statistics.fmean(abs(r["step_error"]) for r in ok),
                  "mem_error": statistics.fmean(abs(r["mem_error"]) for r in ok), "layouts": len(ok)}, None, None)}


def read_recipe(job: Job, out: str) -> dict:
    """recipes/train.py's log: the last logged step's tokens/s, MFU and peak memory."""
    steps = [x for x in open(os.path.join(out, "log.txt"), errors="replace") if x.startswith("step ")]
    if not steps:
        return {}
    found = {key: re.search(pattern, steps[-1]) for key, pattern in
             (("tokens_per_s_per_gpu", r"([\d,]+) tok/s"), ("mfu", r"MFU ([\d.]+)%"),
              ("peak_gib", r"peak mem ([\d.]+) GiB"))}
    figures = {key: float(m.group(1).replace(",", "")) for key, m in found.items() if m}
    if "mfu" in figures:
        figures["mfu"] /= 100
    return {job.name: (figures, None, None)}


def read_convergence(job: Job, out: str) -> dict:
    means = {}
    for name in ("bf16", "fp8", "torchtitan"):
        last = sorted({r["step"]: r["loss"] for r in lines(os.path.join(out, f"{name}.jsonl")) if "loss" in r}.items())
        if last:
            means[name] = statistics.fmean(v for _, v in last[-20:])
    rows, names = {}, {"bf16": "meshtron bf16", "fp8": "meshtron FP8 tensorwise", "torchtitan": "torchtitan bf16"}
    for name, peer in (("bf16", "torchtitan"), ("fp8", "bf16"), ("torchtitan", None)):
        if name in means:
            ratio = means[name] / means[peer] if peer in means else None
            rows[names[name]] = ({"loss": means[name]}, names[peer] if ratio else None, ratio)
    return rows


def documents(name, gpus, recipe, *bench, peer=None):
    """bench_documents.py --train: the recipe's step on the kit's data in file order."""
    argv = ["benchmarks/bench_documents.py", "--train", "--out", "{out}", *bench, "--", *recipe, "--data", DATA]
    return tool(name, gpus, argv, read_documents, peer=peer)


M1 = ["--model", "llama-1B", "--untie-embeddings", "--seq-len", "8192", "--micro-batch", "2", "--global-batch", "2",
      "--compile"]
M617 = ["--model", "llama-617M", "--seq-len", "65536", "--micro-batch", "1", "--global-batch", "1", "--cp", "4",
        "--cp-comm", "a2a"]
CP64 = ["--warmup", "3", "--window", "15", "--rounds", "3", "--profile-steps", "2"]
TT_DOCS = "--training.seq_len 8192 --training.local_batch_size 2 --experimental.custom_import documents_flavors"
ATTENTION = [f"{case}: {v}" for case, variants in (
    ("llama-1B heads", ("SDPA causal", "flex, create_block_mask (built each call)",
                        "flex as shipped (mask built each call)", "flex as shipped (mask built once)",
                        "flex, torch's default tiles (mask built once)", "flex max-autotune (mask built once)",
                        "flash varlen (cu_seqlens built once)")),
    ("llama-617M cp=4 a2a, per rank", ("SDPA causal", "flex as shipped (mask built each call)",
                                       "flex as shipped (mask built once)"))) for v in variants]
CHECKPOINT = ["benchmarks/bench_checkpoint.py", "--dtype", "bf16", "--seq-len", "2048", "--warmup", "3",
              "--out", "{out}"]


SUITES = {
    "1gpu": Suite(
        "One GPU at an H200's memory: llama-1B (16 x 2048) and llama-3B (8 x 2048), Llama 3.2 shapes untied, "
        "bf16, against torchtitan on the same model and batch.",
        [tt("torchtitan llama-1B eager", 1, "llama1b_1gpu", **TT16),
         mt("llama-1B eager", 1, "1gpu", l1b(16), "torchtitan llama-1B eager"),
         tt("torchtitan llama-1B", 1, "llama1b_1gpu_compile", **TT16),
         mt("llama-1B", 1, "1gpu_compile", l1b(16), "torchtitan llama-1B"),
         tt("torchtitan llama-3B", 1, "llama3b_1gpu_compile", **tt_batch(8)),
         mt("llama-3B", 1, "1gpu_compile", l3b(8), "torchtitan llama-3B")]),
    "1gpu-80g": Suite(
        "The one-GPU rows at half the batches, for an 80 GB GPU.",
        [tt("torchtitan llama-1B, 8 x 2048", 1, "llama1b_1gpu_compile", **tt_batch(8)),
         mt("llama-1B, 8 x 2048", 1, "1gpu_compile", l1b(8, micro_batch=8), "torchtitan llama-1B, 8 x 2048"),
         tt("torchtitan llama-3B, 4 x 2048", 1, "llama3b_1gpu_compile", **tt_batch(4)),
         mt("llama-3B, 4 x 2048", 1, "1gpu_compile", l3b(4, micro_batch=4), "torchtitan llama-3B, 4 x 2048")]),
    "fp8": Suite(
        "FP8 matmuls (torchao Float8Linear, output head bf16 on both sides), compiled, one GPU at an H200's memory, "
        "against torchtitan's FP8; bf16 is the `1gpu` suite (`run 1gpu fp8` measures both). The GPT 1.3B has no "
        "peer: its FP8 row is compared with its bf16 row.",
        [tt("torchtitan llama-1B FP8 tensorwise", 1, "llama1b_1gpu_fp8", **TT16),
         mt("llama-1B FP8 tensorwise", 1, "1gpu_fp8_compile", l1b(16), "torchtitan llama-1B FP8 tensorwise"),
         tt("torchtitan llama-1B FP8 rowwise", 1, "llama1b_1gpu_fp8_rowwise", **TT16),
         mt("llama-1B FP8 rowwise", 1, "1gpu_fp8_rowwise_compile", l1b(16), "torchtitan llama-1B FP8 rowwise"),
         tt("torchtitan llama-3B FP8 tensorwise", 1, "llama3b_1gpu_fp8", **tt_batch(8)),
         mt("llama-3B FP8 tensorwise", 1, "1gpu_fp8_compile", l3b(8), "torchtitan llama-3B FP8 tensorwise"),
         mt("GPT 1.3B bf16", 1, "1gpu_compile", GPT8),
         mt("GPT 1.3B FP8 tensorwise", 1, "1gpu_fp8_compile", GPT8, "GPT 1.3B bf16")]),
    "fp8-80g": Suite(
        "The FP8 rows at half the batches, for an 80 GB GPU; bf16 is the `1gpu-80g` suite.",
        [tt("torchtitan llama-1B FP8, 8 x 2048", 1, "llama1b_1gpu_fp8", **tt_batch(8)),
         mt("llama-1B FP8, 8 x 2048", 1, "1gpu_fp8_compile", l1b(8, micro_batch=8),
            "torchtitan llama-1B FP8, 8 x 2048"),
         mt("llama-1B FP8 rowwise, 8 x 2048", 1, "1gpu_fp8_rowwise_compile", l1b(8, micro_batch=8),
            "llama-1B, 8 x 2048"),
         tt("torchtitan llama-3B FP8, 4 x 2048", 1, "llama3b_1gpu_fp8", **tt_batch(4)),
         mt("llama-3B FP8, 4 x 2048", 1, "1gpu_fp8_compile", l3b(4, micro_batch=4),
            "torchtitan llama-3B FP8, 4 x 2048")]),
    "convergence": Suite(
        "300 steps of llama-1B (untied, compiled, 8 x 2048, lr 3e-4 after 30 warm-up steps, cosine to 0.1) on "
        "the kit's c4_test corpus and tokenizer, the same tokens every step on each side "
        "(benchmarks/convergence.sh): the mean loss of the last 20 steps; ratio: loss over the peer's loss "
        "(lower is better). Curves: [convergence.png](convergence.png), per-step records in "
        "[convergence/](convergence).",
        [tool("convergence.sh", 1, ["benchmarks/convergence.sh"], read_convergence, launch="bash",
              rows=["meshtron bf16", "meshtron FP8 tensorwise", "torchtitan bf16"], OUT="{out}")]),
    "fsdp4": Suite(
        "Data parallel on four GPUs: llama-1B ZeRO-1 (16 x 2048 a rank) against torchtitan's FSDP; llama-8B "
        "ZeRO-3 and ZeRO-2 (2 and 4 x 2048 a rank, and 1 x 8192), bf16 and FP8 tensorwise (fp8 all-gathers on both "
        "sides).",
        [tt("torchtitan fsdp4", 4, "llama1b_fsdp4_compile", **TT16),
         mt("dp4 ZeRO-1", 4, "fsdp4_compile", l1b(64), "torchtitan fsdp4"),
         tt("torchtitan fsdp4, eager", 4, "llama1b_fsdp4", **TT16),
         mt("dp4 ZeRO-1, eager", 4, "fsdp4", l1b(64), "torchtitan fsdp4, eager"),
         tt("torchtitan llama-8B fsdp4", 4, "llama8b_fsdp4_compile", **tt_batch(2)),
         mt("llama-8B dp4 ZeRO-3", 4, "fsdp4_zero3_compile", L8B + ["--micro-batch", "2", "--global-batch", "8"],
            "torchtitan llama-8B fsdp4"),
         mt("llama-8B dp4 ZeRO-2", 4, "fsdp4_zero2_compile", L8B + ["--micro-batch", "2", "--global-batch", "8"],
            "torchtitan llama-8B fsdp4"),
         tt("torchtitan llama-8B fsdp4 FP8", 4, "llama8b_fsdp4_fp8", **tt_batch(2)),
         mt("llama-8B dp4 ZeRO-3 FP8", 4, "fsdp4_zero3_fp8_compile",
            L8B + ["--micro-batch", "2", "--global-batch", "8"], "torchtitan llama-8B fsdp4 FP8"),
         tt("torchtitan llama-8B fsdp4, seq 8192", 4, "llama8b_fsdp4_compile", **tt_batch(1, S8K)),
         mt("llama-8B dp4 ZeRO-3, seq 8192", 4, "fsdp4_zero3_compile", L8B_8K, "torchtitan llama-8B fsdp4, seq 8192"),
         tt("torchtitan llama-8B fsdp4 FP8, seq 8192", 4, "llama8b_fsdp4_fp8", **tt_batch(1, S8K)),
         mt("llama-8B dp4 ZeRO-3 FP8, seq 8192", 4, "fsdp4_zero3_fp8_compile", L8B_8K,
            "torchtitan llama-8B fsdp4 FP8, seq 8192"),
         tt("torchtitan llama-8B fsdp4, local batch 4", 4, "llama8b_fsdp4_compile", **tt_batch(4)),
         mt("llama-8B dp4 ZeRO-3, micro-batch 4", 4, "fsdp4_zero3_compile",
            L8B + ["--micro-batch", "4", "--global-batch", "16"], "torchtitan llama-8B fsdp4, local batch 4")]),
    "planner-choice": Suite(
        "llama-1B at global batch 64 on four GPUs: the planner's first choice at commit 12fdd39 against the "
        "fastest layout measured before it (docs/planner.md).",
        [mt("dp4 ZeRO-1, micro-batch 4 (the planner's first choice)", 4, "fsdp4_compile",
            ["--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "4", "--global-batch", "64"]),
         mt("dp4 ZeRO-3, micro-batch 16", 4, "fsdp4_zero3_compile",
            ["--model", "llama-1B", "--seq-len", "2048", "--micro-batch", "16", "--global-batch", "64"],
            "dp4 ZeRO-1, micro-batch 4 (the planner's first choice)")]),
    "tp2": Suite(
        "Two GPUs, llama-1B, 16 x 2048 a model replica, compiled: tp2 + SP and dp2 ZeRO-1 against torchtitan's "
        "tp2 and fsdp2.",
        [tt("torchtitan tp2", 2, "llama1b_tp2_compile", **TT16),
         mt("tp2 + SP", 2, "tp2_compile", l1b(32), "torchtitan tp2"),
         tt("torchtitan fsdp2", 2, "llama1b_fsdp2_compile", **TT16),
         mt("fsdp2", 2, "fsdp2_compile", l1b(32), "torchtitan fsdp2")]),
    "tp2-overlap": Suite(
        "Hiding tp2's communication (llama-1B, as `tp2`): `--tp-overlap` (Megatron's backward overlap) on NCCL "
        "and on the copy engines, every SP collective in pieces under the matmuls (`--tp-overlap-comm chunked`), "
        "and NCCL held to fewer SMs, against the plain row's peer.",
        [tt("torchtitan tp2", 2, "llama1b_tp2_compile", **TT16),
         mt("tp2 + SP", 2, "tp2_compile", l1b(32), "torchtitan tp2"),
         mt("tp2 + SP --tp-overlap", 2, "tp2_overlap_compile", l1b(32), "torchtitan tp2"),
         mt("tp2 + SP --tp-overlap copy-engine", 2, "tp2_overlap_ce_compile", l1b(32), "torchtitan tp2"),
         mt("tp2 + SP --tp-overlap chunked", 2, "tp2_overlap_chunked_compile", l1b(32), "torchtitan tp2"),
         mt("tp2 + SP --tp-overlap, NCCL_MAX_CTAS=8", 2, "tp2_overlap_compile", l1b(32), "torchtitan tp2",
            NCCL_MAX_CTAS="8"),
         mt("tp2 + SP --tp-overlap, NCCL_MAX_CTAS=4", 2, "tp2_overlap_compile", l1b(32), "torchtitan tp2",
            NCCL_MAX_CTAS="4"),
         mt("tp2 + SP, NCCL_MAX_CTAS=8", 2, "tp2_compile", l1b(32), "torchtitan tp2", NCCL_MAX_CTAS="8")]),
    "tp4": Suite(
        "Four GPUs, llama-1B, 16 x 2048 a model replica, compiled: tp4 + SP and dp2 x tp2 + SP against "
        "torchtitan's tp4 and tp2 x fsdp2, in bf16 and FP8 tensorwise (torchtitan's tp2 x fsdp2 gathers its "
        "weights in fp8).",
        [tt("torchtitan tp4", 4, "llama1b_tp4_compile", **TT16),
         mt("tp4 + SP", 4, "tp4_compile", l1b(16), "torchtitan tp4"),
         tt("torchtitan tp2 x fsdp2", 4, "llama1b_tp2fsdp2_compile", **TT16),
         mt("dp2 x tp2 + SP", 4, "tp2dp2_compile", l1b(32), "torchtitan tp2 x fsdp2"),
         tt("torchtitan tp4 FP8", 4, "llama1b_tp4_fp8", **TT16),
         mt("tp4 + SP FP8", 4, "tp4_compile", l1b(16, "--fp8", "tensorwise"), "torchtitan tp4 FP8"),
         tt("torchtitan tp2 x fsdp2 FP8", 4, "llama1b_tp2fsdp2_fp8", **TT16),
         mt("dp2 x tp2 + SP FP8", 4, "tp2dp2_compile", l1b(32, "--fp8", "tensorwise"),
            "torchtitan tp2 x fsdp2 FP8")]),
    "pp": Suite(
        "Pipelines on four GPUs, llama-1B, global batch 32, against data-parallel layouts of the same GPUs and "
        "batch (no torchtitan row): pp2 x tp2 + SP against dp2 x tp2 + SP at micro-batch 4, with and without "
        "`--cuda-graphs` (compiled), and at each layout's natural micro-batch; the schedules' bubbles against "
        "dp4 (eager, micro-batch 4). Bubble: predicted by the schedule's formula, measured as the largest "
        "rank's share of the step with no compute kernel running (its TP collectives count as idle), the median "
        "of five profiled steps.",
        [mt("dp2 x tp2, micro-batch 4", 4, "tp2dp2_compile", PIPE + STEPS5),
         mt("pp2 x tp2, micro-batch 4", 4, "pp2tp2_compile", PIPE + STEPS5, "dp2 x tp2, micro-batch 4"),
         mt("dp2 x tp2 --cuda-graphs, micro-batch 4", 4, "tp2dp2_compile", PIPE + STEPS5 + ["--cuda-graphs"],
            "dp2 x tp2, micro-batch 4"),
         mt("pp2 x tp2 --cuda-graphs, 8 micro-batches of 4", 4, "pp2tp2_compile", PIPE + STEPS5 + ["--cuda-graphs"],
            "pp2 x tp2, micro-batch 4"),
         mt("pp2 x tp2 interleaved --cuda-graphs, 8 micro-batches of 4", 4, "pp2tp2_interleaved_compile",
            PIPE + STEPS5 + ["--cuda-graphs"], "pp2 x tp2, micro-batch 4"),
         mt("pp2 x tp2 --cuda-graphs, 10 micro-batches of 4", 4, "pp2tp2_1f1b_compile",
            l1b(40, "--cuda-graphs", *STEPS5, micro_batch=4)),
         mt("pp2 x tp2 --cuda-graphs, 12 micro-batches of 4", 4, "pp2tp2_1f1b_compile",
            l1b(48, "--cuda-graphs", *STEPS5, micro_batch=4)),
         mt("pp2 x tp2 --cuda-graphs, 16 micro-batches of 4", 4, "pp2tp2_1f1b_compile",
            l1b(64, "--cuda-graphs", *STEPS5, micro_batch=4)),
         mt("dp2 x tp2, micro-batch 16", 4, "tp2dp2_compile", l1b(32)),
         mt("dp2 x tp2 ZeRO-3, micro-batch 16", 4, "tp2dp2_zero3_compile", l1b(32)),
         mt("pp2 x tp2, 4 micro-batches of 8", 4, "pp2tp2_m4_compile", l1b(32, *STEPS5, micro_batch=8),
            "dp2 x tp2, micro-batch 16"),
         mt("dp4 ZeRO-1, micro-batch 4", 4, "fsdp4", PIPE + STEPS5),
         mt("pp4 1F1B", 4, "pp4_1f1b", PIPE + STEPS5, "dp4 ZeRO-1, micro-batch 4"),
         mt("pp4 interleaved", 4, "pp4_interleaved", PIPE + STEPS5, "dp4 ZeRO-1, micro-batch 4"),
         mt("pp4 ZBV", 4, "pp4_zbv", PIPE + STEPS5, "dp4 ZeRO-1, micro-batch 4"),
         mt("dp2 x pp2 1F1B", 4, "dp2pp2_1f1b", PIPE + STEPS5, "dp4 ZeRO-1, micro-batch 4"),
         mt("dp2 x pp2 interleaved", 4, "dp2pp2_interleaved", PIPE + STEPS5, "dp4 ZeRO-1, micro-batch 4"),
         mt("dp2 x pp2 ZBV", 4, "dp2pp2_zbv", PIPE + STEPS5, "dp4 ZeRO-1, micro-batch 4")]),
    "cp1": Suite(
        "Long context on one GPU: llama-617M (torchtitan's cp_8l shape), one sequence a step, not compiled; 16K "
        "against torchtitan, longer alone.",
        [tt("torchtitan cp1 16K", 1, "cp1_16k"),
         mt("16K, one GPU", 1, "1gpu", l617m(16384), "torchtitan cp1 16K")]
        + [mt(f"{k}K, one GPU", 1, "1gpu", l617m(k * 1024)) for k in (32, 64, 96, 128, 160)]),
    "cp2": Suite(
        "Context parallel on two GPUs, llama-617M, one sequence a step, not compiled (ring attention).",
        [tt("torchtitan cp2 32K", 2, "cp2_32k"),
         mt("32K, cp2 (ring)", 2, "cp2", l617m(32768), "torchtitan cp2 32K"),
         mt("352K, cp2 (ring)", 2, "cp2", l617m(360448))]),
    "cp4": Suite(
        "Context parallel on four GPUs, llama-617M, one sequence a step: ring and all-to-all (Ulysses) attention, "
        "eager and compiled, against torchtitan's ring at 64K and 128K. MFU counts attention whole, as "
        "torchtitan does.",
        [tt("torchtitan cp4 64K", 4, "cp4_64k"),
         mt("64K, cp4 (ring)", 4, "cp4", l617m(65536), "torchtitan cp4 64K"),
         tt("torchtitan cp4 128K", 4, "cp4_128k"),
         mt("128K, cp4 (ring)", 4, "cp4", l617m(131072), "torchtitan cp4 128K"),
         mt("128K, cp4 (a2a)", 4, "cp4", l617m(131072, "--cp-comm", "a2a"), "torchtitan cp4 128K"),
         tt("torchtitan cp4 128K, compiled", 4, "cp4_128k", TT3_ARGS="--compile.enable"),
         mt("128K, cp4 (ring), compiled", 4, "cp4_compile", l617m(131072), "torchtitan cp4 128K, compiled"),
         mt("128K, cp4 (a2a), compiled", 4, "cp4_compile", l617m(131072, "--cp-comm", "a2a"),
            "torchtitan cp4 128K, compiled")]),
    "cp-attention": Suite(
        "Context-parallel attention alone (bench_cp.py): 32 heads of 64, 8 KV heads, causal, bf16, forward + "
        "backward, ms; ideal = one GPU's whole sequence / cp; the peer is torch's experimental context_parallel. "
        "Simulated: every cp rank's blocks on one GPU, the share of the ideal and the balance over ranks.",
        [tool("bench_cp.py on two GPUs", 2, ["benchmarks/bench_cp.py", "--reps", "5", "--out", "{out}"], read_cp,
              rows=["32K, cp2", "128K, cp2"]),
         tool("bench_cp.py --simulate 4", 1, ["benchmarks/bench_cp.py", "--simulate", "4", "--reps", "5",
                                              "--out", "{out}"], read_cp, launch="python",
              rows=[f"{k}, cp4 simulated, {v}" for k in ("32K", "128K") for v in ("p2p", "allgather")])]),
    "moe1": Suite(
        "llama-moe-3B (16 experts of 2048, top-2; 2.77B parameters, 0.66B active), 4 x 2048, one GPU, not "
        "compiled, against torchtitan's Qwen3-style MoE of the same shape; each row with its routing load "
        "(max/mean tokens per expert, the worst layer; 1.0 balanced, 8.0 collapsed).",
        [tt("torchtitan moe natural", 1, "moe_1gpu", TT3_ARGS=TT_MOE_LOAD),
         mt("moe, batch balancing (defaults)", 1, "1gpu", MOE + ["--global-batch", "4"], "torchtitan moe natural"),
         mt("moe, the router's own choice", 1, "1gpu", MOE + ["--global-batch", "4", "--moe-batch-balance", "0"],
            "torchtitan moe natural"),
         tt("torchtitan moe balanced", 1, "moe_1gpu", TT3_ARGS=TT_MOE_LOAD + " --debug.moe_force_load_balance"),
         mt("moe, forced balanced", 1, "1gpu", MOE + ["--global-batch", "4", "--moe-balanced-routing"],
            "torchtitan moe balanced")]),
    "ep2": Suite(
        "Expert parallel on two GPUs, llama-moe-3B, 4 x 2048 a rank, the preset's routing: the dispatches "
        "(`--moe-dispatch auto` is padded at ep 2), ZeRO stages and CUDA graphs against torchtitan's dp2 x ep2.",
        [tt("torchtitan dp2 x ep2", 2, "moe_ep2_2gpu"),
         mt("--ep 2 --zero 1", 2, "ep2", MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
         mt("--ep 2 --zero 2", 2, "ep2_zero2", MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
         tt("torchtitan dp2 x ep2, compiled", 2, "moe_ep2_2gpu", TT3_ARGS="--compile.enable", T="240"),
         mt("--ep 2 --zero 1, compiled", 2, "ep2_compile", MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
         mt("--ep 2 --zero 1 --moe-dispatch exact, compiled", 2, "ep2_exact_compile", MOE + ["--global-batch", "8"],
            "torchtitan dp2 x ep2"),
         mt("--ep 2 --zero 0, compiled", 2, "ep2_zero0_compile", MOE + ["--global-batch", "8"],
            "torchtitan dp2 x ep2"),
         mt("--ep 2 --zero 2 --moe-dispatch padded, compiled", 2, "ep2_zero2_padded_compile",
            MOE + ["--global-batch", "8"], "torchtitan dp2 x ep2"),
         mt("--ep 2 --zero 1 --cuda-graphs, compiled", 2, "ep2_compile", MOE + ["--global-batch", "8",
                                                                              "--cuda-graphs"],
            "torchtitan dp2 x ep2"),
         mt("--ep 2 --zero 1 --moe-two-batch", 2, "ep2", MOE + ["--global-batch", "8", "--moe-two-batch"],
            "torchtitan dp2 x ep2")]),
    "ep4": Suite(
        "Expert parallel on four GPUs, llama-moe-3B, 4 x 2048 a rank, against torchtitan's dp4 x ep4, and "
        "experts replicated against torchtitan's FSDP.",
        [tt("torchtitan dp4 x ep4", 4, "moe_ep4"),
         mt("--ep 4 --zero 1", 4, "ep4", MOE + ["--global-batch", "16"], "torchtitan dp4 x ep4"),
         tt("torchtitan dp4 x ep4, compiled", 4, "moe_ep4_compile"),
         mt("--ep 4 --zero 1, compiled", 4, "ep4_compile", MOE + ["--global-batch", "16"],
            "torchtitan dp4 x ep4, compiled"),
         mt("--ep 4 --zero 1 --moe-two-batch", 4, "ep4", MOE + ["--global-batch", "16", "--moe-two-batch"],
            "torchtitan dp4 x ep4"),
         tt("torchtitan moe fsdp4", 4, "moe_fsdp4"),
         mt("dp4 ZeRO-1, experts replicated", 4, "fsdp4", MOE + ["--global-batch", "16"], "torchtitan moe fsdp4")]),
    "moe-balance": Suite(
        "Routing load while llama-moe-3B trains at the recipe's defaults (moe_balance.py, 4 x 2048 a rank, "
        "50 steps): the worst layer's max/mean at the last step, the worst layer's mean over the last 10 steps, "
        "the router's own choice there (before batch balancing), and the loss.",
        [tool("llama-moe-3B --ep 4", 4, ["--local-ranks-filter", "0", "benchmarks/moe_balance.py", *MOE, "--dtype",
                                          "bf16", "--steps", "50", "--every", "10", "--ep", "4", "--zero", "1",
                                          "--out", "{out}/balance.jsonl"], read_balance),
         tool("llama-moe-3B, one GPU", 1, ["benchmarks/moe_balance.py", *MOE, "--dtype", "bf16", "--steps", "50",
                                           "--every", "10", "--out", "{out}/balance.jsonl"], read_balance,
              launch="python")]),
    "moe-experts": Suite(
        "Expert compute on one GPU (bench_moe.py, bf16, d = h = 2048): the experts' grouped GEMMs forward + "
        "backward against one dense MLP of the same FLOPs, at 256-4096 tokens an expert, and one MoE layer "
        "(router, dispatch, combine) against a dense SwiGLU of width k x h at 4K-16K tokens: the dense GPU time "
        "over the MoE's (1 = as fast).",
        [tool("bench_moe.py", 1, ["benchmarks/bench_moe.py", "--out", "{out}"], read_moe, launch="python",
              rows=["4 experts", "16 experts", "one MoE layer, top-2 of 16"])]),
    "documents": Suite(
        "Packed documents (`--document-mask`, FlexAttention) against causal attention and against torchtitan's "
        "flex + block_causal flavor, on the kit's c4_test (mean document 4,499 tokens) read in file order: "
        "llama-1B at 2 x 8,192 on one GPU, llama-617M at 64K and 128K under cp4 (a2a); attention alone "
        "(bench_documents.py --attention, ms, and TFLOP/s of the scores the mask keeps). MFU counts attention "
        "whole; kept: the share of causal scores the mask keeps in the timed samples.",
        [tt("torchtitan causal (sdpa)", 1, "llama1b_1gpu_compile", STEPS="20",
            TT3_ARGS=TT_DOCS + " --model.flavor meshtron_llama1b"),
         documents("llama-1B causal", 1, M1, "--profile-steps", "2", peer="torchtitan causal (sdpa)"),
         tt("torchtitan flex + block_causal", 1, "llama1b_1gpu_compile", STEPS="20",
            TT3_ARGS=TT_DOCS + " --model.flavor meshtron_llama1b_flex"),
         documents("llama-1B --document-mask", 1, M1 + ["--document-mask"], "--profile-steps", "2",
                   peer="torchtitan flex + block_causal"),
         documents("llama-1B --document-mask, torch's default flex tiles", 1, M1 + ["--document-mask"],
                   "--experiment", "default-tiles", peer="torchtitan flex + block_causal"),
         documents("llama-617M 64K cp4 causal", 4, M617, *CP64),
         documents("llama-617M 64K cp4 --document-mask", 4, M617 + ["--document-mask"], *CP64,
                   peer="llama-617M 64K cp4 causal"),
         documents("llama-617M 64K cp4 causal, compiled", 4, M617 + ["--compile"], *CP64),
         documents("llama-617M 64K cp4 --document-mask, compiled", 4, M617 + ["--compile", "--document-mask"], *CP64,
                   peer="llama-617M 64K cp4 causal, compiled"),
         mt("llama-617M 128K cp4 (a2a) --document-mask", 4, "cp4",
            l617m(131072, "--data", DATA, "--no-shuffle", "--cp-comm", "a2a", "--document-mask")),
         tool("bench_documents.py --check --attention", 1,
              ["benchmarks/bench_documents.py", "--check", "--attention", "--autotune", "--data", DATA,
               "--out", "{out}"], read_documents, rows=ATTENTION, launch="python")],
        setup=[PY, "-m", "meshtron.data.prepare", "{assets}/data/c4_test/data.json", "--output-prefix", DATA,
               "--tokenizer", "{assets}/tokenizer", "--workers", "8"], creates=DATA + ".idx"),
    "fused-loss": Suite(
        "`--fused-loss`: the output head and cross-entropy chunk by chunk against the unfused loss, alone at "
        "llama-1B's shapes (16 x 2048 tokens, dim 2048, vocabulary 128,256, bf16, forward + backward): ms, peak "
        "GiB above the inputs, the weight gradient's difference from the unfused eager one; ratio: the compiled "
        "unfused time over the row's.",
        [tool("bench_fused_loss.py", 1, ["benchmarks/bench_fused_loss.py", "--chunks", "2048,4096", "--iters", "8",
                                         "--out", "{out}"], read_fused_loss, launch="python",
              rows=["unfused eager", "unfused, compiled", "fused eager, chunk 2048", "fused compiled, chunk 2048",
                    "fused eager, chunk 4096", "fused compiled, chunk 4096"])]),
    "checkpoint": Suite(
        "What a save costs the step loop (bench_checkpoint.py, the recipe's Trainer, eager bf16): the median "
        "step with no save in flight and with a background write in flight, the loop held by the first save "
        "and by the later ones, the write's seconds; ratio: the blocking hold over the background one.",
        [tool("llama-1B dp2 ZeRO-3", 2, CHECKPOINT + ["--model", "llama-1B", "--dp", "2", "--zero", "3",
                                                       "--micro-batch", "4", "--steps", "420", "--every", "200",
                                                       "--max-saves", "2", "--dir", "/tmp/bench-ck"],
              read_checkpoint, rows=["llama-1B dp2 ZeRO-3, blocking saves", "llama-1B dp2 ZeRO-3, async saves"]),
         tool("llama-8B dp4 ZeRO-3", 4, CHECKPOINT + ["--model", "llama-8B", "--dp", "4", "--zero", "3",
                                                       "--micro-batch", "2", "--global-batch", "8", "--no-check",
                                                       "--steps", "80", "--every", "20", "--max-saves", "1",
                                                       "--dir", "/tmp/bench-ck8"],
              read_checkpoint, rows=["llama-8B dp4 ZeRO-3, blocking saves", "llama-8B dp4 ZeRO-3, async saves"])]),
    "ce-collectives": Suite(
        "tp2 + SP's collectives for llama-1B at micro-batch 16 (128 MiB bf16 reduce-scattered, 64 MiB "
        "all-gathered), 10 back to back on a side stream: ms each alone and beside 8 bf16 matmuls of 8192^3, "
        "and how much longer those matmuls took (bench_ce_collectives.py, two GPUs).",
        [tool("bench_ce_collectives.py", 2, ["benchmarks/bench_ce_collectives.py", "--out", "{out}"], read_ce,
              rows=["NCCL reduce_scatter_tensor", "meshtron ce_reduce_scatter",
                    "torch _low_contention_reduce_scatter", "NCCL all_gather_into_tensor",
                    "torch _low_contention_all_gather"])]),
    "kernels": Suite(
        "meshtron's Triton kernels, GB/s of GPU time (CUDA events, L2 cleared, the host queued ahead) against "
        "eager PyTorch, torch.compile and Liger-Kernel; ratio: against the best of them (bench_kernels.py).",
        [tool("bench_kernels.py", 1, ["benchmarks/bench_kernels.py", "--out", "{out}"], read_kernels, launch="python",
              rows=kernel_rows())]),
    "gpt": Suite(
        "GPT 1.3B (and llama-1B) layouts on two GPUs, sequence 2048, global batch 32, compiled; and, at "
        "micro-batch 16 a replica, the step against stock PyTorch measured beside it at commit aa50b38 (a "
        "plain training loop, stock `parallelize_module`, per-block `fully_shard`: scripts since deleted, git "
        "show 2217d76:benchmarks/bench_parallel.py), MFU against MFU.",
        [mt("GPT 1.3B, one GPU, micro-batch 8", 1, "1gpu_compile", gpt("1.3B", 8, 32)),
         mt("GPT 1.3B, one GPU, micro-batch 4", 1, "1gpu_compile", gpt("1.3B", 4, 32)),
         mt("GPT 1.3B, dp2 ZeRO-1, micro-batch 4", 2, "fsdp2_compile", gpt("1.3B", 4, 32)),
         mt("GPT 1.3B, tp2 + SP, micro-batch 8", 2, "tp2_compile", gpt("1.3B", 8, 32)),
         mt("GPT 1.3B, pp2 1F1B, 8 x 4", 2, "pp2_compile", gpt("1.3B", 4, 32)),
         mt("GPT 1.3B, pp2 interleaved, 8 x 4", 2, "pp2_interleaved_compile", gpt("1.3B", 4, 32)),
         mt("llama-1B, tp2 + SP, micro-batch 8", 2, "tp2_compile", gpt("llama-1B", 8, 32)),
         mt("llama-1B, pp2 1F1B, 8 x 4", 2, "pp2_compile", gpt("llama-1B", 4, 32)),
         mt("GPT 1.3B, one GPU, micro-batch 16", 1, "1gpu_compile", gpt("1.3B", 16, 16)),
         mt("GPT 350M, one GPU, micro-batch 16", 1, "1gpu_compile", gpt("350M", 16, 16)),
         mt("GPT 1.3B, tp2 + SP, micro-batch 16", 2, "tp2_compile", gpt("1.3B", 16, 16)),
         mt("GPT 1.3B, dp2 ZeRO-1, micro-batch 16", 2, "fsdp2_compile", gpt("1.3B", 16, 32))]),
    "recompute": Suite(
        "Activation recomputation on one GPU, sequence 2048, 16 x 2048 a step in micro-batches of 4, compiled; "
        "ratio: against no recompute.",
        [mt(f"{name}, {r}", 1, "1gpu_compile", gpt(m, 4, 16, "--recompute", r),
            None if r == "none" else f"{name}, none")
         for name, m in (("GPT 1.3B", "1.3B"), ("llama-1B", "llama-1B")) for r in ("none", "full", "selective")]),
    "defaults": Suite(
        "What a run gets with no precision flag: llama-1B at 2 x 8192 tokens on one GPU, compiled, through the "
        "recipe (bf16 compute, fp32 master weights and reduction on a GPU), its last logged step.",
        [tool("llama-1B 2 x 8192, no --dtype", 1, ["recipes/train.py", "--model", "llama-1B", "--seq-len", "8192",
                                                    "--micro-batch", "2", "--global-batch", "2", "--compile",
                                                    "--steps", "40", "--log-interval", "10"], read_recipe,
              launch="python")]),
    "plan": Suite(
        "The planner's step time and peak memory against measured runs (bench_plan.py's suites of layouts, each "
        "timed as bench_train.py times a layout): the mean absolute error over a suite's layouts.",
        [tool(s, g, ["benchmarks/bench_plan.py", "--suite", s, "--out", "{out}"], read_plan)
         for s, g in (("1gpu", 1), ("1gpu_compile", 1), ("recompute", 1), ("shapes_1gpu", 1), ("shapes_1gpu_b", 1),
                      ("held_out_1gpu", 1), ("4gpu", 4))]),
}
