"""meshtron: Megatron-style parallel training on one DeviceMesh (dp, pp, cp, tp, ep).

The registered models train through `Trainer` (recipes/train.py). Your own
`nn.Module` trains with the names below (docs/own-model.md): a process group and
a mesh, `parallelize` (and the pipeline split), a loader, the step, the
optimizer, checkpoints and a safetensors export.
"""
import logging

import torch


class _ImportNoise(logging.Filter):
    """torchao, which transformers imports with its model classes, logs on every rank that its CUDA
    kernels do not load and, on torch 2.13, that it registers two enums the deprecated way: lines
    per rank that are not about the run. A kernel that does not load is noise only without CUDA;
    on a GPU machine it is a real failure and is kept."""

    def __init__(self, cuda: bool):
        super().__init__()
        self.noise = ("is an Enum subclass and is now natively supported",) + (() if cuda else ("Failed to load",))

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.noise)


_filter = _ImportNoise(cuda=torch.cuda.is_available())
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_filter)

from meshtron.config import Config, ParallelConfig  # noqa: E402
from meshtron.data import BatchLoader, load_tokens  # noqa: E402
from meshtron.distributed.mesh import AXES, SUBMESHES, batch_slice, degree, init_mesh, submesh  # noqa: E402
from meshtron.distributed.parallelize import parallelize  # noqa: E402
from meshtron.distributed.pipeline_parallel import check_pipeline, split_model, user_stages  # noqa: E402
from meshtron.distributed.reduce import clip_grad_norm_  # noqa: E402
from meshtron.distributed.tensor_parallel import parallelize_module  # noqa: E402
from meshtron.train.checkpoint import latest as latest_checkpoint  # noqa: E402
from meshtron.train.checkpoint import load as load_checkpoint  # noqa: E402
from meshtron.train.checkpoint import save as save_checkpoint  # noqa: E402
from meshtron.train.hf import export_safetensors  # noqa: E402
from meshtron.train.lifetime import init_process_group  # noqa: E402
from meshtron.train.loss import cross_entropy_sum  # noqa: E402
from meshtron.train.optim import build_optimizer  # noqa: E402
from meshtron.train.step import forward_backward  # noqa: E402
from meshtron.train.trainer import Trainer  # noqa: E402

__all__ = ["AXES", "SUBMESHES", "BatchLoader", "Config", "ParallelConfig", "Trainer", "batch_slice",
           "build_optimizer", "check_pipeline", "clip_grad_norm_", "cross_entropy_sum", "degree",
           "export_safetensors", "forward_backward", "init_mesh", "init_process_group", "latest_checkpoint",
           "load_checkpoint", "load_tokens", "parallelize", "parallelize_module", "save_checkpoint", "split_model",
           "submesh", "user_stages"]
