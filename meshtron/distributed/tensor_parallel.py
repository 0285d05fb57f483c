"""Tensor and sequence parallelism on the tp axis of the one mesh.

Megatron's layers as DTensor placements (W is split over p = tp ranks):

  column-parallel  Y = X [W_1 ... W_p]          weight Shard(0), output sharded on the last dim
  row-parallel     Y = sum_i X_i W_i            weight Shard(1), output all-reduced (Replicate)
                                                or reduce-scattered onto the sequence (SP)
  sequence-par.    LayerNorm / dropout on (B, T/p, d) slices, replicated weights
  vocab-parallel   embedding rows Shard(0): local lookup, then all-reduce / reduce-scatter
  loss parallel    cross-entropy on vocab-sharded logits (3 small all-reduces of (B, T)):
                   meshtron.distributed.loss_parallel

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
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module

from meshtron.distributed.tied import retie, tied_groups
from meshtron.distributed.user_pipeline import is_stub


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


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
        and module.weight.ndim == 2


def _conv1d_apply(style, module: nn.Module, mesh: DeviceMesh, placements: dict) -> nn.Module:
    """A column- or row-parallel style on a Conv1D: its parameters take `placements`
    (the transpose of a Linear's) and its addmm runs on DTensors as F.linear does."""
    def partition(name, mod, mesh):
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, nn.Parameter(
                distribute_tensor(p, mesh, [placements[pname]], src_data_rank=None), p.requires_grad))
    return distribute_module(module, mesh, partition,
                             partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
                             partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


class Colwise(ColwiseParallel):
    """torch's ColwiseParallel, on nn.Linear and nn.Embedding and on Conv1D."""

    def _apply(self, module, mesh):
        if is_conv1d(module):
            return _conv1d_apply(self, module, mesh, {"weight": Shard(1), "bias": Shard(0)})
        return super()._apply(module, mesh)


class Rowwise(RowwiseParallel):
    """torch's RowwiseParallel, on nn.Linear and nn.Embedding and on Conv1D."""

    def _apply(self, module, mesh):
        if is_conv1d(module):
            self.desired_input_layouts = (Shard(-1),)
            return _conv1d_apply(self, module, mesh, {"weight": Shard(0), "bias": Replicate()})
        return super()._apply(module, mesh)


class VocabParallel(RowwiseParallel):
    """Embedding rows (the vocabulary) split over tp; the partial lookups are summed
    (all-reduce, or reduce-scatter onto the sequence under SP) and waited for here.
    torch's style leaves that collective pending (an AsyncCollectiveTensor) until its
    first use, inside the first block. A block compiled by torch 2.13 returns no
    gradient for such an input (2.11 does): the embedding's gradient was lost and the
    redistribute's backward, handed a plain tensor, failed. The first use is the next
    op either way, so waiting here costs no overlap."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local(grad_placements=outputs.placements) if use_local_output else outputs


def vocab_parallel(sp: bool = False) -> RowwiseParallel:
    """Embedding rows (the vocabulary) split over tp; the partial lookups are summed."""
    return VocabParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())


STYLES = {
    "colwise": lambda: Colwise(),
    "rowwise": lambda: Rowwise(),
    "colwise_rep": lambda: Colwise(output_layouts=Replicate()),
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


def matches(pattern: str, name: str) -> bool:
    # atom by atom, so "layers.*.attn.qkv" does not reach across dots
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


def split_dims(name: str, mod: nn.Module, style) -> dict[str, int]:
    """{parameter name: the dim `style` splits over tp} of one module; {} for a
    style that splits nothing (the planner reads this too: meshtron.planner.plan)."""
    col = isinstance(style, ColwiseParallel)
    if not col and not isinstance(style, RowwiseParallel):
        return {}
    if isinstance(mod, nn.Embedding):
        dims = {"weight": 1 if col else 0}
    elif isinstance(mod, nn.Linear):
        dims = {"weight": 0, "bias": 0} if col else {"weight": 1}
    elif is_conv1d(mod) and isinstance(style, (Colwise, Rowwise)):
        dims = {"weight": 1, "bias": 0} if col else {"weight": 0}   # Conv1D stores (in, out)
    else:
        raise ValueError(f"{type(style).__name__} on module '{name}' ({type(mod).__name__}): only nn.Linear, "
                         f"nn.Embedding and Hugging Face's Conv1D can be split column- or row-wise")
    return {k: d for k, d in dims.items() if getattr(mod, k, None) is not None}


_SPLIT_NAMES = {("Embedding", 0): "num_embeddings (vocabulary)", ("Embedding", 1): "embedding_dim",
                ("Linear", 0): "out_features", ("Linear", 1): "in_features",
                ("Conv1D", 0): "input features", ("Conv1D", 1): "output features"}


def _check_divisible(name: str, mod: nn.Module, style, tp: int) -> None:
    """A clear error before any distribute_tensor runs."""
    d = split_dims(name, mod, style).get("weight")
    if d is None:
        return
    size = mod.weight.shape[d]
    if size % tp:
        kind = "Embedding" if isinstance(mod, nn.Embedding) else "Linear" if isinstance(mod, nn.Linear) else "Conv1D"
        raise ValueError(f"{type(style).__name__} on module '{name}' ({type(mod).__name__}): "
                         f"{_SPLIT_NAMES[kind, d]} {size} is not divisible by tp={tp}")


def parallelize_module(module: nn.Module, mesh: DeviceMesh, plan: dict, leave: list[nn.Module] = ()) -> nn.Module:
    """Apply a TP plan {glob pattern: style or style name}; replicate what it leaves,
    except the modules in `leave` (mixture-of-experts blocks compute on local
    tensors). Tied parameters stay one parameter (a plan that would place them
    differently is refused); no collective runs (every rank holds the same weights)."""
    tp_mesh = tp_mesh_of(mesh)
    tied = tied_groups(module)
    tp = tp_mesh.size()
    modules = dict(module.named_modules())
    resolved = {}
    for pattern, style in plan.items():
        if isinstance(style, str):
            if style not in STYLES:
                raise ValueError(f"unknown TP style {style!r} for '{pattern}'; known: {sorted(STYLES)}")
            style = STYLES[style]()
        names = [n for n in modules if matches(pattern, n)]
        if not names:
            raise ValueError(f"TP plan entry '{pattern}' matches no module of {type(module).__name__}")
        for n in (n for n in names if not is_stub(modules[n])):   # a pipeline stage's stand-ins stay as they are
            _check_divisible(n, modules[n], style, tp)
            resolved[n] = style
    for style in resolved.values():
        style.src_data_rank = None   # every rank holds the same weights: shard locally, no scatter
    for name, style in resolved.items():
        _torch_parallelize_module(modules[name] if name else module, tp_mesh, style)
    replicate_rest(module, tp_mesh, leave)
    retie(module, tied)
    return module


def replicate_rest(module: nn.Module, tp_mesh: DeviceMesh, leave: list[nn.Module] = ()) -> None:
    """Make the parameters no plan entry touched Replicate() DTensors, so the
    optimizer sees one kind of tensor (stock TP leaves them plain and AdamW's
    foreach path then fails on the mix)."""
    seen = {id(p) for p in module.parameters() if isinstance(p, DTensor)}
    seen |= {id(p) for m in leave for p in m.parameters()}
    for mod in module.modules():
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


def cast_output_to_autocast_dtype(modules) -> None:
    """Under autocast a norm computes and returns fp32, so SP's all-gather of its
    output (and the reduce-scatter of that gradient) would move fp32, twice the
    bytes. The column-parallel linear behind the gather casts to the compute
    dtype anyway, so casting before the gather changes no value (Megatron's
    activations are bf16 there too)."""
    def hook(mod, args, out):
        device = out.device.type
        if device != "meta" and torch.is_autocast_enabled(device):   # meta: the dry run
            return out.to(torch.get_autocast_dtype(device))
    for m in modules:
        m.register_forward_hook(hook)
