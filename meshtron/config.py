"""The config tree: one dataclass per section, a one-line docstring per field.

The command line and --config files are generated from it (meshtron/command_line.py:
`--micro-batch` is `training.micro_batch`), and the same object is what a checkpoint
stores as the run's layout. `validate`
checks everything that needs no model and no process group, so a bad value is
one clear sentence on every rank before anything communicates. It imports no
torch, nor anything that does: the recipe parses and checks the flags before torch
loads (seconds on every rank), so a mistake shows at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from meshtron.command_line import ConfigError, field_docs, parser, preset_training, read_toml
from meshtron.distributed.choices import (
    AXES,
    DTYPES,
    FP8_RECIPES,
    RECOMPUTE_MODES,
    SCHEDULES,
    SPLIT_BACKWARD,
    default_dtype,
    resolve_degrees,
)


def _torch_version() -> str:
    # the running torch where it is loaded; else the installed package's record (importing
    # torch to ask it would cost what checking first saves)
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    try:
        return version("torch")
    except PackageNotFoundError:   # torch from a source tree on the path: ask it
        import torch
        return torch.__version__


def _torch_before(major: int, minor: int) -> bool:
    return tuple(int(v) for v in _torch_version().split(".")[:2]) < (major, minor)


@dataclass
class ModelConfig:
    model: str = "tiny"
    """model preset (see meshtron.models.PRESETS): GPT tiny, 125M, 350M, 1.3B, 2.7B, 6.7B; llama-tiny, llama-1B, ..."""
    untie_embeddings: bool = False
    """a separate output head instead of the tied input embedding"""
    vocab_size: int | None = None
    """vocabulary size (default: the preset's), e.g. a tokenizer's"""
    pos_emb: str | None = field(default=None, metadata={"choices": ("learned", "rope")})
    """GPT positions: learned or rope (default: the preset's)"""
    fused_kernels: bool = True
    """Triton kernels (LayerNorm, bias-GeLU, RMSNorm, SwiGLU) on GPU; plain PyTorch elsewhere"""
    moe_aux_loss: float | None = None
    """mixture of experts: load-balancing loss coefficient (0: off; default: the preset's)"""
    moe_bias_update: float | None = None
    """mixture of experts: expert bias rate, logits per unit of relative load (0: off; default: the preset's)"""
    moe_capacity: float | None = None
    """mixture of experts: capacity factor (0: dropless; default: the preset's)"""
    moe_batch_balance: int | None = None
    """mixture of experts: rounds evening each sequence's top-k in training (0: off; default: the preset's)"""
    moe_balanced_routing: bool = False
    """mixture of experts, speed measurements only: experts assigned round-robin (equal loads), not by the router"""


@dataclass
class ParallelConfig:
    dp: int = -1
    """data-parallel degree (-1: what the world size leaves)"""
    pp: int = 1
    """pipeline-parallel degree"""
    cp: int = 1
    """context-parallel degree"""
    tp: int = 1
    """tensor-parallel degree"""
    ep: int = 1
    """expert-parallel degree"""
    sp: bool = False
    """sequence parallelism (needs tp > 1)"""
    tp_overlap: bool = False
    ("dense Llama blocks under tp: the column-parallel linears' backward starts their input gradient's "
     "reduce-scatter (all-reduce without --sp) and computes their weight gradients while it travels "
     "(Megatron's overlap). NCCL's kernels take SMs from those matmuls, which slow by about what is hidden: "
     "use it with --sp --tp-overlap-comm copy-engine on CUDA GPUs, where tp's exposed communication bounds the step")
    tp_overlap_comm: str = field(default="nccl", metadata={"choices": ("nccl", "copy-engine", "chunked")})
    ("the collective --tp-overlap hides under --sp: nccl (NCCL's reduce-scatter kernels, which take SMs from "
     "the matmuls beside them), copy-engine (CUDA only: each rank pushes its peers' blocks with cudaMemcpy "
     "into torch's symmetric memory, then adds what arrived; the matmuls keep their SMs) or chunked (every "
     "all-gather before a column-parallel linear and reduce-scatter after a row-parallel one, forward and "
     "backward, cut into one piece per tp rank, each moving while the previous piece's matmul runs)")
    cp_comm: str = field(default="p2p", metadata={"choices": ("p2p", "allgather", "a2a")})
    """context-parallel attention: p2p (ring), allgather (K/V) or a2a (Ulysses, heads)"""
    moe_dispatch: str = field(default="auto", metadata={"choices": ("auto", "exact", "padded")})
    ("mixture of experts under --ep: exact all-to-alls (split sizes copied to the host: one device sync "
     "per layer), padded ones (equal splits of every rank's copies: no host sync, ep x the all-to-all "
     "bytes and buffers), or auto: padded at --ep 2, where the doubled bytes cost less than the host sync, "
     "exact above, where the padding grows with ep")
    moe_two_batch: bool = False
    ("mixture of experts under --ep: split each micro-batch into two halves of whole sequences whose layers "
     "alternate, so that one half's attention and experts run while the other half's dispatch and combine "
     "all-to-alls travel, in forward and in backward (SGLang's and DeepSeek's two-batch overlap); the same "
     "losses, gradients and routing statistics as without it")
    loss_parallel: bool = True
    """cross-entropy on vocab-sharded logits under tp (else the logits are gathered)"""
    fused_loss: bool = False
    """the output head's matmul and the cross-entropy chunk by chunk over the tokens (the logits never exist whole)"""
    zero: int = field(default=1, metadata={"choices": (0, 1, 2, 3)})
    """ZeRO stage over the data-parallel axes (0 = DDP)"""
    hsdp: int = 1
    """HSDP replica groups (1 = plain FSDP)"""
    pp_schedule: str = field(default="1f1b", metadata={"choices": SCHEDULES})
    """pipeline schedule"""
    pp_virtual: int = 1
    """virtual stages per pp rank (interleaved and zero-bubble schedules)"""
    microbatches: int | None = None
    """micro-batches per step (default: pp with pipelining, else the local batch / --micro-batch)"""
    recompute: str = field(default="none", metadata={"choices": RECOMPUTE_MODES})
    """activation recomputation (selective runs its policy in Python per op: pair it with --compile on a GPU)"""
    compile: bool = False
    """torch.compile each block"""
    cuda_graphs: bool = False
    ("CUDA graphs of the compiled blocks (needs --compile and GPUs): each block's kernels and collectives "
     "replayed by one launch, for steps whose small micro-batches leave the GPUs waiting on the host's "
     "launches (pp x tp, dp x tp); FSDP's gathered weights stay in place between steps (refused with --zero 3)")
    dtype: str | None = field(default=None, metadata={"choices": DTYPES})
    """compute dtype (default: bf16 on GPUs, fp32 on the CPU); master weights and the reduction stay fp32"""
    reduce_dtype: str = field(default="fp32", metadata={"choices": DTYPES})
    """gradient reduction dtype"""
    fp8: str = field(default="none", metadata={"choices": FP8_RECIPES})
    ("""FP8 matmuls (torchao Float8Linear, with --dtype bf16): tensorwise or rowwise scales; what stays in the """
     """compute dtype: embeddings, norms, the output head, MoE routers and experts, and linears with a dim """
     """that is not a multiple of 16""")
    mixed_precision: str = field(default="autocast", metadata={"choices": ("autocast", "fsdp")})
    """one process's bf16/fp16: torch.autocast on fp32 weights, or FSDP2's policy on a one-rank mesh"""

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}


@dataclass
class TrainingConfig:
    steps: int = 50
    """optimizer steps (the learning-rate schedule spans them)"""
    micro_batch: int = 4
    """samples per micro-batch per data-parallel rank"""
    global_batch: int | None = None
    """samples per optimizer step (default: micro-batch x micro-batches x data-parallel ranks)"""
    seq_len: int = 128
    """tokens per sample"""
    lr: float = field(default=1e-3, metadata={"preset": True})
    """peak learning rate"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of the peak"""
    warmup: int = field(default=10, metadata={"preset": True})
    """linear warmup steps"""
    weight_decay: float = 0.1
    """AdamW weight decay (not on biases and norms)"""
    max_norm: float = 1.0
    """clip by global gradient norm (0: off)"""
    seed: int = 0
    """seed of the initial weights, the sample order and dropout"""
    log_interval: int = 10
    """steps between log lines"""
    metrics_file: str | None = None
    """append one JSON line per logged step (and evaluation) to this file"""
    tensorboard: str | None = None
    """write TensorBoard event files to this directory (needs the tensorboard package)"""
    pg_timeout: float = 600
    """seconds a collective may wait before the job fails"""
    hang_timeout: float | None = None
    ("seconds a rank may make no progress (a step's data loading, forward/backward, optimizer) before the job "
     "ends, each rank's stacks and flight recorder written and the ranks that did not arrive named (default: 5 "
     "x the slowest step seen, 30 s at least, half of --pg-timeout at most; watched from the second step; 0: off)")
    straggler_threshold: float = 1.2
    ("at each log line, name a rank whose busy time a step (computing, loading data: the step less its wait "
     "in collectives) exceeds the ranks' median by this factor (0: off)")


@dataclass
class DataConfig:
    data: str | None = None
    """text file or directory, .u16/.u32 token file, indexed-dataset prefix, or blend '0.7 A 0.3 B' (default: stdlib)"""
    tokenizer: str | None = None
    """a tokenizer.json directory for text data (default: bytes)"""
    eval_data: str | None = None
    """held-out data for evaluation (the same kinds as --data)"""
    eval_interval: int = 100
    """steps between evaluations (and one at the last step) when --eval-data is given"""
    eval_steps: int = 10
    """global batches per evaluation"""
    shuffle: bool = True
    """draw each epoch's samples in a seeded random order (--no-shuffle: file order, as torchtitan's loader reads)"""
    document_mask: bool = False
    """attend only within each packed document, causally (Megatron's --reset-attention-mask; FlexAttention on GPUs)"""
    document_positions: bool = False
    """restart the positions (RoPE or learned) at each document's start (Megatron's --reset-position-ids)"""
    eod_mask_loss: bool = False
    """no loss where a document's last token would predict the next document's first (Megatron's --eod-mask-loss)"""


@dataclass
class CheckpointConfig:
    checkpoint_dir: str | None = None
    """save distributed checkpoints under this directory"""
    checkpoint_interval: int = 100
    """steps between checkpoints"""
    keep_checkpoints: int = 3
    """keep the newest K checkpoints"""
    checkpoint_async: bool = False
    """write each checkpoint in the background: the loop holds only while the state is copied to host memory"""
    resume: str = "none"
    """none, auto (the newest good checkpoint in --checkpoint-dir) or a checkpoint path"""
    data_rebatch: bool = False
    """resume with another global batch or sequence length at the same token count"""
    schedule_override: bool = False
    ("resume under other --steps, --warmup, --lr, --min-lr-ratio or --weight-decay than the checkpoint's "
     "(else refused): the learning-rate schedule is planned again from the resumed step, going on from the "
     "learning rate there to the new end")
    init_from_hf: str | None = None
    """build the model from this Hugging Face directory's config.json and start from its weights"""
    import_safetensors: str | None = None
    """start the --model preset from these safetensors (Hugging Face names; a config.json must match it)"""
    export_hf: str | None = None
    """write a Hugging Face model directory here at the end (config.json, safetensors)"""


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @staticmethod
    def from_args(argv=None, description: str | None = None, models=None) -> Config:
        """The command line over an optional --config file over the defaults.
        `models`: the presets --model accepts (meshtron.models.PRESETS, or without torch
        meshtron.models.presets.TRAINING: see command_line.preset_training)."""
        return Config.parse(argv, description, models)[0]

    @staticmethod
    def parse(argv=None, description: str | None = None, models=None) -> tuple[Config, argparse.Namespace]:
        """from_args, and the parsed flags too: the ones that are actions rather than
        settings (--dry-run) are the caller's to act on. --print-config prints and exits."""
        p = parser(SECTIONS, description, models)
        first, _ = p.parse_known_args(argv)
        if first.config:
            p.set_defaults(**read_toml(first.config, SECTIONS, models))
        args = p.parse_args(argv)
        preset = preset_training(models, args.model)
        for f in dataclasses.fields(TrainingConfig):
            if f.metadata.get("preset") and getattr(args, f.name) is None:   # neither a flag nor --config gave it
                setattr(args, f.name, preset.get(f.name, f.default))
        config = Config(**{name: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
                           for name, cls in SECTIONS.items()})
        if args.print_config:
            if os.environ.get("RANK", "0") == "0":
                print(config.to_toml(), end="")
            sys.exit(0)
        return config, args

    def on_device(self, device_type: str) -> Config:
        """This config with --dtype resolved for a run on `device_type` (cuda or cpu)."""
        dtype = self.parallel.dtype or default_dtype(device_type, self.parallel.fp8)
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, dtype=dtype))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The tree as a file --config reads back (unset values are comments)."""
        lines = []
        for name, cls in SECTIONS.items():
            lines.append(f"[{name}]")
            docs = field_docs(cls)
            for f in dataclasses.fields(cls):
                value = getattr(getattr(self, name), f.name)
                text = "true" if value is True else "false" if value is False else json.dumps(value)
                lines.append(f"{'# ' if value is None else ''}{f.name} = {'(unset)' if value is None else text}"
                             f"   # {docs[f.name]}")
            lines.append("")
        return "\n".join(lines)

    def validate(self, world_size: int) -> dict[str, int]:
        """Every check that needs neither the model nor a process group; returns the
        five degrees on `world_size` ranks (dp=-1 resolved)."""
        t, p, c = self.training, self.parallel, self.checkpoint
        for name, value in (("--steps", t.steps), ("--micro-batch", t.micro_batch), ("--seq-len", t.seq_len),
                            ("--log-interval", t.log_interval), ("--checkpoint-interval", c.checkpoint_interval),
                            ("--keep-checkpoints", c.keep_checkpoints), ("--pp-virtual", p.pp_virtual),
                            ("--hsdp", p.hsdp), ("--eval-interval", self.data.eval_interval),
                            ("--eval-steps", self.data.eval_steps)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, not {value}")
        for name, value in (("--global-batch", t.global_batch), ("--microbatches", p.microbatches)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, not {value}")
        if t.hang_timeout is not None and not 0 <= t.hang_timeout < t.pg_timeout:
            raise ConfigError(f"--hang-timeout {t.hang_timeout:g} must be at least 0 (0: off) and below --pg-timeout "
                              f"{t.pg_timeout:g}, which fails a waiting collective first")
        if t.straggler_threshold != 0 and not t.straggler_threshold > 1:
            raise ConfigError(f"--straggler-threshold {t.straggler_threshold:g} must be above 1 (a factor of the "
                              "median busy time), or 0 (off)")
        if t.warmup < 0 or t.max_norm < 0 or t.lr <= 0:
            raise ConfigError(f"--warmup and --max-norm must be >= 0 and --lr > 0 (got {t.warmup}, {t.max_norm}, "
                              f"{t.lr})")
        if p.sp and p.tp == 1:
            raise ConfigError("--sp (sequence parallelism) shards the sequence over tp ranks: it needs --tp > 1")
        if p.compile and p.pp > 1 and p.pp_schedule in SPLIT_BACKWARD and _torch_before(2, 13):
            raise ConfigError(f"--pp-schedule {p.pp_schedule} with --compile needs torch 2.13 or later: the split "
                              f"backward of torch {_torch_version()} fails inside compiled blocks; use "
                              "interleaved-1f1b or leave out --compile")
        if p.pp > 1 and p.ep > 1 and _torch_before(2, 13):
            raise ConfigError(f"--pp with --ep needs torch 2.13 or later: under torch {_torch_version()} the "
                              "pipelined experts' router gradients differ from one process's (the parity test of "
                              "pp2 x ep2 fails there); leave out --pp or --ep")
        if p.cuda_graphs and not p.compile:
            raise ConfigError("--cuda-graphs records the compiled blocks as CUDA graphs: it needs --compile")
        if p.tp_overlap and p.sp and p.cp > 1:
            raise ConfigError("--tp-overlap with --sp and --cp is not supported: context parallelism takes the "
                              "rotary positions from the attention's gathered input, which --tp-overlap gathers "
                              "inside the projections; leave out --tp-overlap")
        if p.tp_overlap_comm != "nccl" and not (p.tp_overlap and p.sp):
            raise ConfigError(f"--tp-overlap-comm {p.tp_overlap_comm} chooses the collective of --tp-overlap "
                              "under --sp: it needs --tp-overlap and --sp")
        if p.tp_overlap_comm == "copy-engine" and p.cuda_graphs:
            raise ConfigError("--tp-overlap-comm copy-engine with --cuda-graphs is not supported: its side stream "
                              "and symmetric-memory workspace are not recorded; use one of the two")
        if p.tp_overlap_comm == "chunked" and p.cuda_graphs:
            raise ConfigError("--tp-overlap-comm chunked with --cuda-graphs is not supported: compiled blocks run "
                              "its pieces outside the graphs; use one of the two")
        if p.tp_overlap_comm == "chunked" and p.fp8 not in ("none", "tensorwise"):
            raise ConfigError(f"--tp-overlap-comm chunked with --fp8 {p.fp8} is not supported: it scales each "
                              "piece with its whole tensor's scale, and a rowwise gradient's scales span the tp ranks "
                              "and the pieces; use --fp8 tensorwise")
        if p.fp8 != "none" and p.dtype not in (None, "bf16"):
            raise ConfigError(f"--fp8 runs its matmuls in fp8 inside bf16 compute: leave out --dtype {p.dtype} "
                              "(or give --dtype bf16)")
        if p.fp8 != "none":
            from meshtron.distributed.float8 import check_available
            try:
                check_available()
            except ImportError as e:
                raise ConfigError(str(e)) from None
        if c.checkpoint_async and not c.checkpoint_dir:
            raise ConfigError("--checkpoint-async writes the checkpoints of --checkpoint-dir in the background: "
                              "give one")
        if c.resume == "auto" and not c.checkpoint_dir:
            raise ConfigError("--resume auto looks for checkpoints in --checkpoint-dir: give one")
        try:
            d = resolve_degrees(world_size, **p.degrees())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        zero3 = p.zero == 3 and d["dp"] * d["cp"] * d["ep"] > 1   # resharded over FSDP's dense axes
        if d["pp"] > 1 and p.pp_schedule in SPLIT_BACKWARD and zero3:
            raise ConfigError(f"--pp-schedule {p.pp_schedule} computes weight gradients outside FSDP's backward, "
                              "and with --zero 3 (parameters resharded after each forward) some of them are lost: "
                              "use --zero 2 (the same sharded gradients and optimizer state) or another schedule")
        if p.cuda_graphs and zero3:
            raise ConfigError("--cuda-graphs keeps FSDP's gathered weights in place between steps (the graphs read "
                              "them where they recorded them), which with --zero 3 would hold every block's "
                              "gathered weights: use --zero 2 (the same sharded gradients and optimizer state)")
        if p.moe_dispatch not in ("auto", "exact") and d["ep"] == 1:
            raise ConfigError(f"--moe-dispatch {p.moe_dispatch} changes expert parallelism's all-to-alls: it needs "
                              "--ep > 1")
        data = self.data
        if p.moe_two_batch:
            self._check_two_batch(d)
        if data.document_mask and d["cp"] > 1 and p.cp_comm != "a2a":
            raise ConfigError(f"--document-mask under context parallelism takes --cp-comm a2a (Ulysses: each rank "
                              f"attends over the whole sequence, which the mask covers); --cp-comm {p.cp_comm} "
                              "does not take a mask")
        return d

    def _check_two_batch(self, d: dict[str, int]) -> None:
        """--moe-two-batch's layouts (meshtron.distributed.two_batch)."""
        p = self.parallel
        if p.compile:
            raise ConfigError("--moe-two-batch with --compile (and so --cuda-graphs) is not supported: the "
                              "halves alternate in a Python scheduler between their all-to-alls, which "
                              "torch.compile does not trace; leave out --compile")
        for axis, why in (("tp", "the MoE blocks' tensor-parallel layouts are hooks on their call, which the "
                                 "halves' stages do not make"),
                          ("cp", "context parallelism's attention does not run by halves yet")):
            if d[axis] > 1:
                raise ConfigError(f"--moe-two-batch with --{axis} {d[axis]} is not supported: {why}")
        if self.data.document_mask:
            raise ConfigError("--moe-two-batch with --document-mask is not supported: FlexAttention's mask on "
                              "GPUs cannot be cut into the halves' masks")
        if d["ep"] == 1:
            raise ConfigError("--moe-two-batch overlaps expert parallelism's all-to-alls with the other half's "
                              "work: it needs --ep > 1")
        if self.training.micro_batch % 2:
            raise ConfigError(f"--moe-two-batch splits each micro-batch into two halves of whole sequences: "
                              f"--micro-batch {self.training.micro_batch} must be even")
