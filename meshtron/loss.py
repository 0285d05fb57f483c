"""The loss, one path for every layout: cross-entropy summed over a micro-batch's
tokens in fp32; the trainer divides by the number of target tokens of the whole
global batch, counted over every rank (targets IGNORE_INDEX not counted), so the
loss is the global token mean whatever the layout or the padding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

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


def loss_function(device: torch.device, vocab_sharded: bool):
    """cross_entropy_sum, compiled on a GPU: inductor fuses the fp32 upcast, the
    log-softmax and its backward over the (tokens x vocabulary) logits into a few
    passes (benchmarks/HISTORY.md, second session). Eager on vocab-sharded DTensor logits (loss
    parallel: meshtron.distributed.loss_parallel keeps no fp32 copy of them) and on
    the CPU, where compiling costs more than it saves."""
    if device.type == "cuda" and not vocab_sharded:
        return torch.compile(cross_entropy_sum)
    return cross_entropy_sum
