"""Tensor and sequence parallelism on the tp axis of the one mesh.

Megatron's layers as DTensor placements (W is split over p = tp ranks):

  column-parallel  Y = X [W_1 ... W_p]          weight Shard(0), output sharded on the last dim
  row-parallel     Y = sum_i X_i W_i            weight Shard(1), output all-reduced (Replicate)
                                                or reduce-scattered onto the sequence (SP)
  sequence-par.    LayerNorm / dropout on (B, T/p, d) slices, replicated weights
  vocab-parallel   embedding rows Shard(0): local lookup, then all-reduce / reduce-scatter
  loss parallel    cross-entropy on vocab-sharded logits (3 small all-reduces of (B, T))

Per transformer layer, forward: without SP one all-reduce per block (2 per
layer); with SP one all-gather before each column-parallel linear and one
reduce-scatter after each row-parallel one (2 + 2 per layer, same bytes as
the two all-reduces, but activations outside the linears are 1/p). Backward
mirrors it.

`parallelize_module(module, mesh, plan)` works on any model: the plan maps
glob patterns of module names to styles (objects or the strings users of other
libraries write). Afterwards every parameter is a DTensor on the tp mesh, so
stock AdamW (foreach / fused), clip_grad_norm_ and DCP work unchanged.
"""
from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel)
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module


class ReplicateParallel(ParallelStyle):
    """Parameters Replicate() on tp; inputs and outputs stay local tensors.

    Every tp rank sees the same input and computes the same full gradient, so
    nothing is communicated. With `output_shard_dim`, the (replicated) output
    is cut to this rank's slice along that dim, e.g. learned position
    embeddings feeding a sequence-parallel residual stream.
    """

    def __init__(self, output_shard_dim: int | None = None):
        self.output_shard_dim = output_shard_dim

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                if not isinstance(p, DTensor):
                    mod.register_parameter(pname, nn.Parameter(
                        distribute_tensor(p, mesh, [Replicate()], src_data_rank=None), p.requires_grad))

        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def outputs(mod, out, mesh):
            if not isinstance(out, DTensor):
                return out
            if self.output_shard_dim is not None:
                out = out.redistribute(mesh, [Shard(self.output_shard_dim)])
            return out.to_local(grad_placements=out.placements)

        return distribute_module(module, mesh, partition, inputs, outputs)


def vocab_parallel(sp: bool = False) -> RowwiseParallel:
    """Embedding rows (the vocabulary) split over tp; the partial lookups are summed."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())


STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(),
    "replicate": lambda: ReplicateParallel(),
    "vocab_parallel": lambda: vocab_parallel(),
}


def tp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """Accept the whole 5-D mesh (use its tp axis) or a 1-D tp mesh."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh
    if "tp" not in names:
        raise ValueError(f"mesh with axes {names} has no 'tp' axis; pass the meshtron mesh or a 1-D tp mesh")
    return mesh["tp"]


def _matches(pattern: str, name: str) -> bool:
    # atom by atom, so "layers.*.attn.qkv" does not reach across dots
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


def _check_divisible(name: str, mod: nn.Module, style, tp: int) -> None:
    """A clear error before any distribute_tensor runs."""
    if isinstance(mod, nn.Embedding) and isinstance(style, RowwiseParallel):
        dim, what = mod.num_embeddings, "num_embeddings (vocabulary)"
    elif isinstance(mod, nn.Embedding) and isinstance(style, ColwiseParallel):
        dim, what = mod.embedding_dim, "embedding_dim"
    elif isinstance(mod, nn.Linear) and isinstance(style, ColwiseParallel):
        dim, what = mod.out_features, "out_features"
    elif isinstance(mod, nn.Linear) and isinstance(style, RowwiseParallel):
        dim, what = mod.in_features, "in_features"
    elif isinstance(style, (ColwiseParallel, RowwiseParallel)):
        raise ValueError(f"{type(style).__name__} on module '{name}' ({type(mod).__name__}): only nn.Linear and "
                         f"nn.Embedding can be split column- or row-wise")
    else:
        return
    if dim % tp:
        raise ValueError(f"{type(style).__name__} on module '{name}' ({type(mod).__name__}): {what} {dim} "
                         f"is not divisible by tp={tp}")


def parallelize_module(module: nn.Module, mesh: DeviceMesh, plan: dict) -> nn.Module:
    """Apply a TP plan {glob pattern: style or style name}; replicate what it leaves."""
    tp_mesh = tp_mesh_of(mesh)
    tp = tp_mesh.size()
    modules = dict(module.named_modules())
    resolved = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in STYLES:
                raise ValueError(f"unknown TP style {style!r} for '{pattern}'; known: {sorted(STYLES)}")
            style = STYLES[style]()
        names = [n for n in modules if _matches(pattern, n)]
        if not names:
            raise ValueError(f"TP plan entry '{pattern}' matches no module of {type(module).__name__}")
        for n in names:
            _check_divisible(n, modules[n], style, tp)
            resolved[n] = style
    for style in resolved.values():
        style.src_data_rank = None   # every rank holds the same weights: shard locally, no scatter
    for name, style in resolved.items():
        _torch_parallelize_module(modules[name] if name else module, tp_mesh, style)
    replicate_rest(module, tp_mesh)
    return module


def replicate_rest(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the parameters no plan entry touched Replicate() DTensors, so the
    optimizer sees one kind of tensor (stock TP leaves them plain and AdamW's
    foreach path then fails on the mix)."""
    seen = {id(p) for p in module.parameters() if isinstance(p, DTensor)}
    for name, mod in module.named_modules():
        own = [p for p in mod.parameters(recurse=False) if not isinstance(p, DTensor) and id(p) not in seen]
        if own:
            ReplicateParallel()._apply(mod, tp_mesh)


def fork_rng_per_rank(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron's model-parallel RNG for a region whose tensors are sharded over tp
    (local heads, or sequence slices held as local tensors): each tp rank must draw
    different random numbers there. The seed for the region is drawn from the
    default generator, which all tp ranks share and activation recomputation
    replays, so masks are reproducible and recomputed identically."""
    rank = tp_mesh.get_local_rank()
    saved = []

    def pre(mod, args):
        seed = int(torch.randint(0, 2**62, (1,)))
        saved.append((torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None))
        torch.default_generator.manual_seed(seed + rank)
        if torch.cuda.is_available():
            torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(seed + rank)

    def post(mod, args, out):
        cpu, cuda = saved.pop()
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


# ---- meshtron's GPT ---------------------------------------------------------

def gpt_plan(model: nn.Module, sp: bool, loss_parallel: bool) -> dict:
    """The Megatron plan for meshtron's GPT. The fused QKV weight is laid out head
    by head, so its column split gives each rank whole heads of q, k and v."""
    seq = Shard(1) if sp else Replicate()
    norm = SequenceParallel() if sp else ReplicateParallel()
    plan = {
        "tok_embeddings": vocab_parallel(sp),
        "layers.*.attn_norm": norm,
        "layers.*.attn": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attn.qkv": ColwiseParallel(),
        "layers.*.attn.proj": RowwiseParallel(output_layouts=seq),
        "layers.*.mlp_norm": norm,
        "layers.*.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.mlp.fc1": ColwiseParallel(),
        "layers.*.mlp.fc2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel() if sp else ReplicateParallel(),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if getattr(model, "pos_embeddings", None) is not None:
        plan["pos_embeddings"] = ReplicateParallel(output_shard_dim=0 if sp else None)
    present = dict(model.named_modules())
    # a pipeline stage holds only some of these modules
    return {k: v for k, v in plan.items() if any(_matches(k, n) for n in present)}


def _to_autocast_dtype(mod, args, out):
    """Under autocast a LayerNorm computes and returns fp32, so SP's all-gather of
    its output (and the reduce-scatter of that gradient) would move fp32, twice
    the bytes. The column-parallel linear behind the gather casts to the compute
    dtype anyway, so casting before the gather changes no value (Megatron's
    activations are bf16 there too)."""
    device = out.device.type
    if torch.is_autocast_enabled(device):
        return out.to(torch.get_autocast_dtype(device))


def apply_gpt_tp(model: nn.Module, mesh: DeviceMesh, sp: bool = True, loss_parallel: bool = True) -> nn.Module:
    tp_mesh = tp_mesh_of(mesh)
    tied = model.config.tie_embeddings and model.tok_embeddings is not None and model.output is not None
    parallelize_module(model, tp_mesh, gpt_plan(model, sp, loss_parallel))
    if tied:
        # both are Shard(0) over the vocabulary; re-tie so there is one parameter and one gradient
        model.output.weight = model.tok_embeddings.weight
    if sp:
        for name, mod in model.named_modules():
            if name == "norm" or name.endswith(("attn_norm", "mlp_norm")):
                mod.register_forward_hook(_to_autocast_dtype)
    if model.config.dropout > 0:
        sharded = [f"layers.{i}.attn.core" for i in model.layers]  # heads are split in attention
        if sp:  # the residual stream is split over the sequence: its dropouts are sharded too
            sharded += ["emb_dropout"] + [f"layers.{i}.{d}" for i in model.layers
                                          for d in ("attn.resid_dropout", "mlp.dropout")]
        present = dict(model.named_modules())
        for name in sharded:
            if name in present:
                fork_rng_per_rank(present[name], tp_mesh)
    return model
