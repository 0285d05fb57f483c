"""The cost model and layout planner: per-rank memory and step time of a layout,
and every valid layout for a number of GPUs, ranked.

    python -m meshtron.plan --model llama-8B --seq-len 8192 --global-batch 64 --gpus 64 --gpus-per-node 8
    python -m meshtron.plan calibrate --out h200.json      # then --gpu h200.json (meshtron.planner.calibrate)

(the command line: meshtron.planner.cli)

It reads the trainer's own pieces: the config tree (a layout is a
ParallelConfig and a micro-batch), the model spec (its TP plan, pipeline split,
layout checks, FLOPs), `split_dims`, `stage_ids_of` and the sub-meshes FSDP
shards over. So a new model or axis is planned without new planner code.

Memory: meshtron.planner.memory.

Step time: the model's FLOPs at a matmul efficiency (calibrated per GPU),
each collective of the step (meshtron.planner.comm_model: calls and bytes per kind and
mesh axes, equal to what a real step issues) by the alpha-beta model on the
link its group crosses (all-reduce 2(n-1)/n of the bytes, all-gather and
reduce-scatter (n-1)/n, all-to-all (n-1)/n, p2p 1): TP and EP traffic exposed,
CP's ring behind attention, FSDP's overlapped with compute except one unit's
worth, the pipeline's bubble by its schedule's formula. What a step on several
GPUs adds (step_time) is fitted per machine to measured steps (meshtron.planner.fit):
compile's and TP's effect on the kernels, collectives inside a step, the host per
collective call and micro-batch (a micro-batch takes the longer of its GPU and host
time), the bubble's scale, FSDP's overlap cost; FP8's GEMMs, casts and gathers.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from meshtron import models
from meshtron.config import ParallelConfig
from meshtron.distributed.mesh import AXES
from meshtron.distributed.pipeline_parallel import bubble_fraction, check_pipeline
from meshtron.planner.comm_model import group_size, step_collectives
from meshtron.planner.hardware import GPUS, Hardware, hardware
from meshtron.planner.memory import _layer_elements, _routed_blocks, memory_bytes, pp_rank_memory
from meshtron.planner.state import coordinate, state_bytes

GiB = 2 ** 30


# ---- activations and step time --------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    par: ParallelConfig
    micro_batch: int
    microbatches: int
    memory: float            # bytes on the fullest rank: state + gathered + activations
    state: float             # fp32 parameters, gradients, optimizer state, as sharded
    activations: float
    gathered: float          # the unsharded bf16 weights computed with
    step_s: float
    mfu: float
    exposed_comm_s: float

    def flags(self) -> str:
        p, d = self.par, self.par.degrees()
        out = [f"--{a} {d[a]}" for a in AXES if d[a] > 1 or a == "dp"]
        out += ["--sp"] * p.sp + [f"--zero {p.zero}", f"--micro-batch {self.micro_batch}"]
        if d["pp"] > 1:
            out += [f"--pp-schedule {p.pp_schedule}"] + [f"--pp-virtual {p.pp_virtual}"] * (p.pp_virtual > 1)
        if p.recompute != "none":
            out.append(f"--recompute {p.recompute}")
        if p.hsdp > 1:
            out.append(f"--hsdp {p.hsdp}")
        if p.compile:
            out.append("--compile")
        if p.fp8 != "none":
            out.append(f"--fp8 {p.fp8}")
        return " ".join(out)


def _link(axis: str, degrees: dict[str, int], gpus_per_node: int, hw: Hardware) -> tuple[float, float]:
    """The (alpha, bandwidth) of the link an axis' groups cross: the inner axes' ranks
    are adjacent, so a group spans stride * size consecutive ranks."""
    inner = AXES[AXES.index(axis) + 1:]
    span = math.prod(degrees[a] for a in inner) * degrees[axis]
    if span > gpus_per_node:
        return hw.inter
    if hw.intra_bus:   # the bus bandwidth measured for the nearest group size at or below this one
        sizes = sorted(hw.intra_bus)
        bw = next((b for n, b in reversed(sizes) if n <= degrees[axis]), sizes[0][1])
        return hw.intra[0], bw
    return hw.intra


def collective_s(kind: str, nbytes: float, n: int, link: tuple[float, float]) -> float:
    """alpha-beta time of one collective over n ranks moving `nbytes` (the full tensor)."""
    if n <= 1:
        return 0.0
    alpha, bw = link
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n, "p2p": 1.0}[kind]
    return alpha * (n - 1 if kind != "p2p" else 1) + nbytes * factor / bw


def _pp_ranks(d: dict[str, int]) -> set[int]:
    """A rank of the first pipeline stage (the embedding), of the last (the head, the
    loss) and of one between (activations both ways; the ranks between are alike)."""
    stride = math.prod(d[a] for a in AXES[AXES.index("pp") + 1:])
    return {0, min(1, d["pp"] - 1) * stride, (d["pp"] - 1) * stride}


@functools.cache
def _group(label: str, degrees: tuple[int, ...], hsdp: int, gpus_per_node: int, hw: Hardware):
    """(ranks, (alpha, bandwidth)) of a CollectiveCounter group: the link of its
    outermost axis (an HSDP replica group spans dp, its shard group the inner axes)."""
    d = dict(zip(AXES, degrees))
    axes = [a for a in AXES if a in label.split("+")] or (["dp"] if label == "dp_replicate" else
                                                          [a for a in ("ep", "cp", "dp") if d[a] > 1][:1])
    return group_size(d, label, hsdp), _link(axes[0], d, gpus_per_node, hw)


def comm_s(spec, cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int, hw: Hardware,
           gpus_per_node: int, rank: int = 0) -> tuple[float, float, float, float, float, int]:
    """Seconds `rank` spends in one step's collectives (comm_model.step_collectives,
    each by the alpha-beta model on its group's link): (tp, ep all-to-all, cp ring,
    pp, the data-parallel rest), and how many calls it issues (receives excepted)."""
    calls, nbytes = step_collectives(spec, cfg, par, micro_batch, microbatches, seq_len, rank, by_part=True)
    degrees = tuple(par.degrees().values())
    out = dict.fromkeys(("tp", "ep", "cp", "pp", "dp"), 0.0)
    issued = 0
    for (part, kind, label), n_calls in calls.items():
        if kind == "recv":   # the mirror of a send: the link carries both at once
            continue
        issued += n_calls
        n, link = _group(label, degrees, par.hsdp, gpus_per_node, hw)
        full = nbytes[(part, kind, label)] * (n if kind == "all_gather" else 1)    # the whole tensor
        if par.fp8 == "tensorwise" and part == "dp" and kind == "all_gather":
            full /= 2   # FSDP gathers the converted linears (nearly all the bytes) in fp8
        out[part] += n_calls * collective_s("p2p" if kind == "send" else kind, full / n_calls,
                                            2 if kind == "send" else n, link)
    return out["tp"], out["ep"], out["cp"], out["pp"], out["dp"], issued


# Bytes the memory-bound kernels of a step move, counted from the code that runs them; the
# machine's measured HBM bandwidth turns them into time.
PARAM_BYTES = 28 + 12     # per fp32 parameter a rank holds: fused AdamW reads it, its gradient and two
                          # moments and writes three; the global-norm clip reads each gradient and scales it
CAST_BYTES = 6 + 8        # per parameter computed with and micro-batch, bf16 compute: the fp32 weight read and
                          # its bf16 copy written; the bf16 weight gradient written, read and added in fp32
ACCUMULATE_BYTES = 8      # the same in fp32 compute: each micro-batch's gradient added into the last
LOSS_BYTES = 16           # per logit: the logits read, log-softmax's fp32 written, read back in backward and
                          # its gradient written in the compute dtype
PERMUTE_BYTES = 48        # per routed copy and model dim: a MoE block's gather of the tokens in expert order and
                          # its gradient's scatter (bf16), the fp32 weighted sum and its gradient
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def family(cfg) -> str:
    """The model family whose host time a layer takes: moe, llama or gpt."""
    if getattr(cfg, "moe", None) is not None:
        return "moe"
    return "llama" if hasattr(cfg, "ffn_dim") else "gpt"


def _expert_params(cfg) -> int:
    moe = getattr(cfg, "moe", None)
    if moe is None:
        return 0
    per = 3 * cfg.dim * moe.hidden if moe.activation == "swiglu" else 2 * cfg.dim * moe.hidden + moe.hidden + cfg.dim
    return cfg.n_layers * moe.n_experts * per


def compute_s(cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int, hw: Hardware,
              layers: int) -> tuple[float, float]:
    """(GEMM and attention seconds, memory-bound seconds) of one rank's step, composed from the
    machine's measured parts:
    - the matmuls at the calibrated efficiency for GEMMs of a micro-batch's rows (its cp-local
      tokens; SP gathers the whole of them) in the compute dtype, FP8's block linears at fp8's;
    - causal attention (half of the 12*L*d*T that flops_per_token counts) at the calibrated
      efficiency for its head dim, (cp-local) sequence and dtype;
    - the memory-bound rest at the HBM bandwidth: each saved activation written in forward, read
      in backward and its gradient written (3x the saved bytes), the loss over the logits, a MoE
      block's token permutations, and per parameter the optimizer and clipping (what this rank
      holds) and the compute-dtype copies and gradients (what it computes with, per micro-batch)."""
    d = par.degrees()
    dtype = par.dtype or "bf16"
    tokens = micro_batch * microbatches * seq_len          # per data-parallel rank and step
    local = tokens / d["cp"]
    shard = d["cp"] * d["tp"] * d["pp"]
    attention = 12 * cfg.n_layers * cfg.dim * seq_len * tokens / shard
    matmul = cfg.flops_per_token(seq_len) * tokens / shard - attention
    fp8 = _block_linear_flops(cfg, seq_len) * tokens / shard if par.fp8 != "none" else 0.0
    if par.recompute == "full":
        matmul, attention, fp8 = matmul * 4 / 3, attention * 4 / 3, fp8 * 4 / 3
    efficiency = hw.peak_flops * hw.matmul_at(micro_batch * seq_len / d["cp"])
    fp8_ratio = hw.dtype_ratio("fp8" if par.fp8 == "tensorwise" else "fp8_rowwise")
    attention_eff = hw.peak_flops * hw.attention_at(cfg.dim // cfg.n_heads, seq_len / d["cp"]) * \
        (hw.attention_fp32_ratio if dtype == "fp32" else 1.0)
    gemms = ((matmul - fp8) / hw.dtype_ratio(dtype) + fp8 / fp8_ratio) / efficiency + attention / 2 / attention_eff
    elementwise = 3 * DTYPE_BYTES[dtype] * local * _layer_elements(cfg, d["tp"], par.sp, _routed_blocks(par)) * layers
    if par.recompute == "selective":   # the memory-bound ops run again, reading what the matmuls saved
        elementwise *= 4 / 3
    loss = LOSS_BYTES * local * cfg.vocab_size / d["tp"] / d["pp"]
    moe = getattr(cfg, "moe", None)
    permute = PERMUTE_BYTES * local * moe.top_k * _routed_blocks(par) * cfg.dim * layers if moe else 0.0
    computed = (cfg.num_params() - _expert_params(cfg) * (1 - 1 / d["ep"])) / (d["tp"] * d["pp"])
    per_microbatch = ACCUMULATE_BYTES if dtype == "fp32" else CAST_BYTES
    params = PARAM_BYTES * cfg.num_params() / math.prod(d.values()) + per_microbatch * computed * microbatches
    return gemms, (elementwise + loss + permute + params) / hw.hbm_bandwidth


@dataclass(frozen=True)
class StepTerms:
    """A layout's step, before the machine's multi-GPU terms (Hardware's fitted fields)
    combine it (step_time): what `calibrate --fit` fits those terms on."""
    compute: float           # calibrated matmul and attention seconds (one GPU's calibration)
    memory: float            # the memory-bound kernels' bytes at the measured HBM bandwidth
    fp8_cast: float          # FP8's casts at the HBM bandwidth (before fp8_cast_bytes scales them)
    tp: float                # alpha-beta seconds of each part's collectives
    ep: float
    cp: float                # what of the ring the attention does not hide
    pp: float
    fsdp: float
    calls: int               # collective calls this rank issues a step
    host_eager: float        # eager host seconds (per micro-batch and layer, calibrated on one GPU)
    microbatches: int
    layers: int
    moe_calls: float         # MoE blocks run (micro-batches x layers, again under full recompute)
    bubble: float            # the schedule's formula
    compiled: bool


def step_time(t: StepTerms, hw: Hardware) -> tuple[float, float]:
    """(step seconds, exposed communication seconds): each micro-batch takes the longer of its
    GPU work (compute, then the tp, ep and cp collectives, which wait for their inputs) and the
    host's (launches and dispatch per micro-batch and per collective call; ranks out of step wait
    inside the next collective); the pipeline idles its bubble share of that; FSDP's gathers and
    reductions run behind the compute except one unit's and what the compute cannot cover."""
    compute = (t.compute + t.memory) * (hw.compute_scale_compiled if t.compiled else hw.compute_scale_eager) + \
        t.fp8_cast * hw.fp8_cast_bytes + t.moe_calls * hw.moe_layer_s
    exposed = (t.tp + t.ep + t.cp) * hw.comm_scale
    fsdp = t.fsdp * hw.comm_scale
    if t.compiled:
        host = t.microbatches * hw.host_microbatch_compiled_s + t.calls * hw.host_collective_compiled_s
    else:
        host = t.host_eager * hw.host_scale + t.calls * hw.host_collective_s
    busy = max(compute + exposed, host)
    bubble = min(t.bubble * hw.bubble_scale, 0.95)
    fsdp_exposed = max(0.0, fsdp - compute) + fsdp / max(1, t.layers)
    fsdp_exposed += hw.overlap_cost * (fsdp - fsdp_exposed)
    return busy / (1 - bubble) + t.pp + fsdp_exposed, exposed + t.pp + fsdp_exposed


def _block_linear_flops(cfg, seq_len: int) -> float:
    """Per token, forward and backward: the blocks' matmul FLOPs (what FP8 converts): all but
    the attention's scores and the output head, which stays in the compute dtype."""
    return cfg.flops_per_token(seq_len) - 12 * cfg.n_layers * cfg.dim * seq_len - 6 * cfg.dim * cfg.vocab_size


def _fp8_cast_elements(cfg, tp: int) -> float:
    """Per token and layer on a tp rank: the elements FP8 casts, each linear's input forward
    and its output's gradient backward (attention's q, k, v, o and the MLP's three)."""
    h = cfg.dim
    kv = getattr(cfg, "n_kv_heads", cfg.n_heads) * (h // cfg.n_heads)
    ffn = getattr(cfg, "ffn_dim", None) or cfg.ffn_mult * h
    return (3 * h + ffn + 3 * h + 2 * kv + 2 * ffn) / tp


def step_terms(spec, cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int, hw: Hardware,
               gpus_per_node: int) -> StepTerms:
    d = par.degrees()
    layers = math.ceil(cfg.n_layers / d["pp"])
    tokens = micro_batch * microbatches * seq_len          # per data-parallel rank and step
    compute, memory = compute_s(cfg, par, micro_batch, microbatches, seq_len, hw, layers)
    fp8_cast = 0.0
    if par.fp8 != "none":
        fp8_cast = tokens / d["cp"] * layers * _fp8_cast_elements(cfg, d["tp"]) / hw.hbm_bandwidth
        if par.fp8 == "rowwise" and hw.fp8_cast_bytes:   # step_time counts fp8_cast_bytes per element
            fp8_cast *= hw.fp8_rowwise_cast_bytes / hw.fp8_cast_bytes
    host_eager = microbatches * (hw.host_microbatch_s + layers * hw.host_layer(par.recompute, family(cfg)))
    worst = None
    for rank in _pp_ranks(d):
        comm = comm_s(spec, cfg, par, micro_batch, microbatches, seq_len, hw, gpus_per_node, rank)
        if worst is None or sum(comm[:5]) > sum(worst[:5]):
            worst = comm
    tp_comm, ep_comm, cp_ring, pp_comm, fsdp, calls = worst
    cp_comm = cp_ring   # the all-gather and all-to-all variants wait for their collectives
    if d["cp"] > 1 and par.cp_comm == "p2p":   # the ring's transfers run behind the attention of the block before
        attention = 6 * micro_batch * seq_len ** 2 / d["cp"] * cfg.dim / d["tp"] / (   # causal, as compute_s
            hw.peak_flops * hw.attention_at(cfg.dim // cfg.n_heads, seq_len / d["cp"]))
        cp_comm = max(0.0, cp_ring - attention * layers * microbatches)
    bubble = bubble_fraction(par.pp_schedule, d["pp"], microbatches, par.pp_virtual) if d["pp"] > 1 else 0.0
    moe_calls = microbatches * layers * (4 / 3 if par.recompute == "full" else 1) if family(cfg) == "moe" else 0.0
    return StepTerms(compute, memory, fp8_cast, tp_comm, ep_comm, cp_comm, pp_comm, fsdp, calls, host_eager,
                     microbatches, layers, moe_calls, bubble, par.compile)


def predict(spec, cfg, par: ParallelConfig, micro_batch: int, microbatches: int, seq_len: int, hw: Hardware,
            gpus_per_node: int, memo: dict | None = None) -> Prediction:
    """Memory and step time of one layout; `memo` shares the state bytes between
    layouts that differ only in micro-batching, recompute or compiling."""
    d = par.degrees()
    memory, state, acts, gathered = memory_bytes(spec, cfg, par, micro_batch, microbatches, seq_len, memo)
    step, exposed = step_time(step_terms(spec, cfg, par, micro_batch, microbatches, seq_len, hw, gpus_per_node), hw)
    model_flops = cfg.flops_per_token(seq_len) * micro_batch * microbatches * seq_len * d["dp"] * d["ep"]
    return Prediction(par, micro_batch, microbatches, memory, state, acts, gathered, step,
                      model_flops / (step * math.prod(d.values()) * hw.peak_flops), exposed)


# ---- enumeration ------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def layouts(spec, cfg, gpus: int, seq_len: int, global_batch: int, gpus_per_node: int, dtype: str = "bf16",
            compile: bool = False, fp8: str = "none"):
    """Every (ParallelConfig, micro-batch, micro-batches) the trainer accepts for this job."""
    moe = getattr(cfg, "moe", None)
    for tp, pp, cp, ep in itertools.product(_divisors(gpus), repeat=4):
        if gpus % (tp * pp * cp * ep) or tp > gpus_per_node or (ep > 1 and moe is None):
            continue
        dp = gpus // (tp * pp * cp * ep)
        batch_ranks = dp * ep
        if global_batch % batch_ranks:
            continue
        for zero, mb, recompute, (schedule, virtual) in itertools.product(
                (0, 1, 2, 3), MICRO_BATCHES, ("none", "selective", "full"),
                [("1f1b", 1), ("interleaved-1f1b", 2)] if pp > 1 else [("1f1b", 1)]):
            if global_batch % (batch_ranks * mb) or (dp * cp * ep == 1 and zero != 1):
                continue   # with nothing to shard over, the trainer runs zero 1
            if recompute == "selective" and moe is not None:
                continue
            m = global_batch // (batch_ranks * mb)
            par = ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, sp=tp > 1, zero=zero, recompute=recompute,
                                 pp_schedule=schedule, pp_virtual=virtual, dtype=dtype, microbatches=m,
                                 compile=compile, fp8=fp8)
            try:
                spec.check_layout(cfg, par.degrees(), par, seq_len)
                if pp > 1:
                    check_pipeline(schedule, pp, virtual, m, cfg.n_layers)
            except ValueError:
                continue
            yield par, mb, m


def plan(model: str, seq_len: int, global_batch: int, gpus: int, gpus_per_node: int = 8,
         gpu: str = "h200", compile: bool = False, fp8: str = "none",
         cfg=None, dtype: str = "bf16") -> tuple[list[Prediction], list[Prediction]]:
    """(layouts that fit, fastest first; those that do not, smallest first); `cfg`: the
    model's config where it differs from the preset's (--untie-embeddings...)."""
    spec, preset = models.get(model)
    cfg = preset if cfg is None else cfg
    hw = hardware(gpu)
    memo = {}
    preds = [predict(spec, cfg, par, mb, m, seq_len, hw, gpus_per_node, memo)
             for par, mb, m in layouts(spec, cfg, gpus, seq_len, global_batch, gpus_per_node, dtype, compile=compile,
                                       fp8=fp8)]
    fit = sorted((p for p in preds if p.memory <= hw.memory_bytes), key=lambda p: (p.step_s, p.memory))
    over = sorted((p for p in preds if p.memory > hw.memory_bytes), key=lambda p: p.memory)
    return fit, over


__all__ = ["GPUS", "Hardware", "Prediction", "comm_s", "coordinate", "layouts", "plan", "pp_rank_memory", "predict",
           "state_bytes", "step_collectives"]
