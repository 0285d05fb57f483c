"""FP8 training: torchao's Float8Linear in place of a model's nn.Linear layers.

A converted linear runs its three matmuls (output, input gradient, weight
gradient) on float8 operands, each scaled dynamically from its own absolute
maximum, and returns the compute dtype; master weights, gradients, optimizer
state and checkpoints stay in high precision (the parameter is the same fp32
tensor under the same name).

  tensorwise  one scale per tensor: e4m3 for inputs and weights, e5m2 for
              output gradients (cuBLAS's fp8 GEMM, the fastest). Under FSDP over
              dp > 1 ranks the fp32 shards are cast to fp8 before the all-gather
              (half of bf16's bytes, the gathered weight already the GEMM's operand), with
              every weight's scale computed after the optimizer step in one
              all-reduce (`precompute_scales`). Under TP, SP's all-gathers carry
              fp8 activations (torchao's Float8 TP styles: `tp_plan`).
  rowwise     one scale per row, e4m3 throughout, scales rounded down to powers
              of two: more accurate, a slower GEMM; weights gathered and TP's
              collectives run in the compute dtype.

What stays in high precision (`convertible`): embeddings and norms; the output
head (its logits feed the loss) and mixture-of-experts routers (fp32 by design),
by the skip patterns each model passes; linears with a dim that is not a
multiple of 16 (the fp8 GEMM's constraint); the experts' 3-D grouped-GEMM
weights (not nn.Linear); and nn.Linear subclasses with a forward of their own,
unless they name what follows the linear: a subclass with an `activation(y)`
method (the GPT's fused LinearGeLU fc1) becomes a Float8Linear that applies it,
the bias add and activation then left to compile to fuse.

Order (torchtitan's): convert before TP, which then shards Float8Linear
weights, before recompute, compile and FSDP. On a device without fp8 matmuls
(the CPU) torchao emulates them: the same fp8 rounding, matmuls in the compute
dtype; that is how the CPU tests check every layout.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from meshtron.distributed.choices import FP8_RECIPES as RECIPES

# the linears meshtron.parallelize leaves in the compute dtype unless told otherwise: output heads, routers
DEFAULT_SKIP = ("output", "lm_head", "*router*")


def check_available() -> None:
    """A clear error (before anything communicates) where torchao is missing."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ImportError(f"--fp8 needs torchao ({e}): pip install 'meshtron[fp8]'") from None


def float8_config(recipe: str, *, fsdp_all_gather: bool, emulate: bool):
    """torchao's Float8LinearConfig for `recipe`. fp8 all-gather under FSDP exists
    for tensorwise scales only (a row's scale would need the whole row)."""
    from torchao.float8 import Float8LinearConfig
    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulate)
    if recipe == "rowwise":
        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    raise ValueError(f"fp8 recipe must be one of {RECIPES[1:]}, not {recipe!r}")


def emulated(device_type: str) -> bool:
    """Emulate the fp8 matmuls off CUDA; refuse a GPU without fp8 tensor cores."""
    if device_type != "cuda":
        return True
    if torch.cuda.get_device_capability() < (8, 9):
        raise ValueError(f"--fp8 needs fp8 matmuls (compute capability 8.9 or later: Ada, Hopper); "
                         f"{torch.cuda.get_device_name()} has {torch.cuda.get_device_capability()}")
    return False


def convertible(name: str, module: nn.Module, skip=(), tp: int = 1) -> bool:
    """Whether the linear `name` computes in fp8 (see the module docstring); its dims
    must stay multiples of 16 after a split over `tp` ranks."""
    if type(module) is not nn.Linear and not (isinstance(module, nn.Linear) and hasattr(module, "activation")):
        return False
    if any(fnmatch.fnmatchcase(name, p) for p in skip):
        return False
    return module.in_features % (16 * tp) == 0 and module.out_features % (16 * tp) == 0


def convert(model: nn.Module, recipe: str, device_type: str, *, skip=DEFAULT_SKIP, tp: int = 1,
            fsdp_all_gather: bool = False) -> list[str]:
    """Swap every convertible nn.Linear of `model` (on any device, meta included)
    for a Float8Linear holding the same parameters; returns their names. Nothing
    for recipe "none"."""
    if recipe == "none":
        return []
    check_available()
    from torchao.float8.float8_linear import Float8Linear
    config = float8_config(recipe, fsdp_all_gather=fsdp_all_gather and recipe == "tensorwise",
                           emulate=emulated(device_type))
    names = [n for n, m in model.named_modules() if convertible(n, m, skip, tp)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        linear = getattr(owner, child)
        if type(linear) is nn.Linear:
            setattr(owner, child, Float8Linear.from_float(linear, config=config))
        else:
            new = _float8_then().from_float(linear, config=config)
            new.activation = linear.activation   # a function of the linear's output alone
            setattr(owner, child, new)
    return names


@functools.cache
def _float8_then():
    """Float8Linear followed by the activation its model's Linear subclass names
    (a class made once, on first use: torchao is an optional import)."""
    from torchao.float8.float8_linear import Float8Linear

    class Float8LinearThen(Float8Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.activation(super().forward(x))
    return Float8LinearThen


def is_float8(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear
    return isinstance(module, Float8Linear)


def tp_plan(plan: dict, model: nn.Module, recipe: str, matches, device_type: str) -> dict:
    """The TP plan with torchao's float8 styles where they apply (tensorwise, CUDA):
    column/row-parallel entries on Float8Linear modules, and the PrepareModuleInput
    of a module whose linears are all Float8Linear, so SP's all-gather moves the
    fp8 input once for all of them. Anything else keeps its style (a bf16 linear
    must not receive an fp8 input). `matches(pattern, name)`: the plan's glob.

    Elsewhere the plain styles stay: the Float8Linear then casts the gathered
    DTensor, whose absolute maximum is the same global one, so the fp8 operands are
    the same and only the collectives' dtype differs (gloo has no fp8 dtypes)."""
    if recipe != "tensorwise" or device_type != "cuda":
        return plan
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )
    modules = dict(model.named_modules())
    out = {}
    for key, style in plan.items():
        found = [m for n, m in modules.items() if matches(key, n)]
        linear = isinstance(style, (ColwiseParallel, RowwiseParallel))
        if linear and found and all(is_float8(m) for m in found):
            new = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            out[key] = new(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                           use_local_output=style.use_local_output)
        elif isinstance(style, PrepareModuleInput) and found and all(_all_float8(m) for m in found):
            out[key] = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
                use_local_output=style.use_local_output)
        else:
            out[key] = style
    return out


def _all_float8(module: nn.Module) -> bool:
    linears = [c for c in module.children() if isinstance(c, nn.Linear)]
    return bool(linears) and all(is_float8(c) for c in linears)


@torch.no_grad()
def precompute_scales(parts: list[nn.Module]) -> None:
    """The scale of every weight that FSDP gathers in fp8, from its fp32 shards: one
    stacked max-reduction per mesh (an all-reduce per mesh axis; a MoE block's dense
    parts and the attention live on different meshes under TP). Run it before the first step (after the weights are
    initialized or loaded) and after every optimizer step, as the trainer does: a
    stale scale saturates the weights, and without any, torchao's fallback reduces
    each maximum over the dp ranks only, so under FSDP x TP every tp shard would get
    a scale of its own and the result would depend on the layout."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    groups: dict = {}
    for m in (m for part in parts for m in part.modules() if is_float8(m)):
        w = m.weight
        if isinstance(w, DTensor) and isinstance(w._local_tensor, WeightWithDynamicFloat8CastTensor):
            groups.setdefault((w.device_mesh, w.placements), []).append(m)
    for linears in groups.values():
        amax = torch.stack(torch._foreach_norm([m.weight for m in linears], ord=math.inf))
        amax = amax.full_tensor() if isinstance(amax, DTensor) else amax
        dtype = linears[0].config.cast_config_weight.target_dtype
        # as torchao's own scale (float8_utils.amax_to_scale): in float64, then fp32
        scale = (torch.finfo(dtype).max / amax.clamp_min(1e-12).double()).float()
        for m, s in zip(linears, scale):
            m.weight._local_tensor._precomputed_scale = s


def compile_options(parallel) -> dict | None:
    """Inductor options for compiled blocks under --fp8: rowwise casts must round as
    eager does (torchtitan sets the same, process-wide; here per compile)."""
    return {"emulate_precision_casts": True} if parallel.fp8 == "rowwise" else None
