"""The loss, one path for every layout: cross-entropy summed over a micro-batch's
tokens in fp32; the trainer divides by the number of target tokens of the whole
global batch, counted over every rank (targets IGNORE_INDEX not counted), so the
loss is the global token mean whatever the layout or the padding.

Two paths to it: the model returns logits and cross_entropy_sum reads them
(loss_function), or, with --fused-loss, the model returns its final hidden states
and FusedLoss runs the output head's matmul and the cross-entropy chunk by chunk
over the tokens, so the (tokens x vocabulary) logits never exist
(meshtron.distributed.fused_loss). The step calls the model with
`forward_kwargs(loss_fn)`."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from meshtron.distributed.fused_loss import fused_linear_cross_entropy_sum
from meshtron.distributed.loss_parallel import vocab_parallel_cross_entropy_sum

IGNORE_INDEX = -100


def logits_of(output) -> torch.Tensor:
    """A model's logits: the tensor it returns, or a Hugging Face output's `.logits`."""
    return output if isinstance(output, torch.Tensor) else output.logits


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (logits may be bf16, or a DTensor split over the
    vocabulary by tensor parallelism: then without gathering them)."""
    if isinstance(logits, DTensor) and isinstance(logits.placements[-1], Shard):
        return vocab_parallel_cross_entropy_sum(logits, targets, IGNORE_INDEX)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)


class FusedLoss:
    """(final hidden states, targets) -> summed token cross-entropy through `head`,
    an nn.Linear without bias (a tied one too). Its weight is read at each call, as
    the head holds it then: FSDP's root unit keeps it gathered after the forward
    (meshtron.distributed.data_parallel), tensor parallelism splits it over the
    vocabulary. `compiled`: the per-chunk softmax through torch.compile (GPU)."""

    def __init__(self, head: nn.Linear, compiled: bool = False, chunk: int | None = None,
                 dtype: torch.dtype | None = None):
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ValueError(f"the fused loss needs an output head that is an nn.Linear without bias, not {head}")
        self.head, self.compiled, self.chunk, self.dtype = head, compiled, chunk, dtype

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy_sum(hidden, self.head.weight, targets, IGNORE_INDEX, self.chunk,
                                              self.compiled, self.dtype)


def forward_kwargs(loss_fn) -> dict:
    """What the model's forward is called with for this loss: the fused loss wants the
    final hidden states instead of the logits."""
    return {"return_hidden": True} if isinstance(loss_fn, FusedLoss) else {}


def output_head(parts: list[nn.Module]) -> nn.Linear | None:
    """The model's output head (its `output` nn.Linear; a pipeline's last stage holds
    it, the others a stand-in), or None."""
    heads = [m.output for m in parts if isinstance(getattr(m, "output", None), nn.Linear)]
    return heads[-1] if heads else None


def loss_function(device: torch.device, vocab_sharded: bool, head: nn.Linear | None = None,
                  autocast: torch.dtype | None = None):
    """cross_entropy_sum, compiled on a GPU: inductor fuses the fp32 upcast, the
    log-softmax and its backward over the (tokens x vocabulary) logits into a few
    passes. Eager on vocab-sharded DTensor logits (loss
    parallel: meshtron.distributed.loss_parallel keeps no fp32 copy of them) and on
    the CPU, where compiling costs more than it saves. Given the output `head`, the
    fused loss (FusedLoss) instead, compiled on a GPU likewise, its matmul in the
    forward's `autocast` dtype where one is given."""
    if head is not None:
        return FusedLoss(head, compiled=device.type == "cuda", dtype=autocast)
    if device.type == "cuda" and not vocab_sharded:
        return torch.compile(cross_entropy_sum)
    return cross_entropy_sum
