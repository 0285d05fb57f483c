"""meshtron: Megatron-style parallel training on one DeviceMesh (dp, pp, cp, tp, ep).

The registered models train through `Trainer` (recipes/train.py). Your own
`nn.Module` trains with the names below (docs/own-model.md): a process group and
a mesh, `parallelize` (and the pipeline split), a loader, the step, the
optimizer, checkpoints and a safetensors export.

Each name loads its module on first use (PEP 562): importing the package imports
no torch, so the recipe can check its flags before torch's seconds of import.
"""
import logging

from meshtron._lazy import lazy


class _ImportNoise(logging.Filter):
    """torchao, which transformers imports with its model classes, logs on every rank that its CUDA
    kernels do not load and, on torch 2.13, that it registers two enums the deprecated way: lines
    per rank that are not about the run. A kernel that does not load is noise only without CUDA;
    on a GPU machine it is a real failure and is kept. `cuda` None: torch says, at each such
    record (torch is loaded by then: the records come from torchao)."""

    ENUM = "is an Enum subclass and is now natively supported"
    KERNEL = "Failed to load"

    def __init__(self, cuda: bool | None = None):
        super().__init__()
        self.cuda = cuda

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.ENUM in message:
            return False
        return self.KERNEL not in message or self._cuda()

    def _cuda(self) -> bool:
        if self.cuda is not None:
            return self.cuda
        import torch
        return torch.cuda.is_available()


_filter = _ImportNoise()
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_filter)

_HOME = {  # name -> (module, its name there)
    "Config": ("meshtron.config", "Config"),
    "ParallelConfig": ("meshtron.config", "ParallelConfig"),
    "BatchLoader": ("meshtron.data", "BatchLoader"),
    "load_tokens": ("meshtron.data", "load_tokens"),
    "AXES": ("meshtron.distributed.mesh", "AXES"),
    "SUBMESHES": ("meshtron.distributed.mesh", "SUBMESHES"),
    "batch_slice": ("meshtron.distributed.mesh", "batch_slice"),
    "degree": ("meshtron.distributed.mesh", "degree"),
    "init_mesh": ("meshtron.distributed.mesh", "init_mesh"),
    "submesh": ("meshtron.distributed.mesh", "submesh"),
    "parallelize": ("meshtron.distributed.parallelize", "parallelize"),
    "check_pipeline": ("meshtron.distributed.pipeline_parallel", "check_pipeline"),
    "split_model": ("meshtron.distributed.pipeline_parallel", "split_model"),
    "user_stages": ("meshtron.distributed.pipeline_parallel", "user_stages"),
    "clip_grad_norm_": ("meshtron.distributed.reduce", "clip_grad_norm_"),
    "parallelize_module": ("meshtron.distributed.tensor_parallel", "parallelize_module"),
    "latest_checkpoint": ("meshtron.train.checkpoint", "latest"),
    "load_checkpoint": ("meshtron.train.checkpoint", "load"),
    "save_checkpoint": ("meshtron.train.checkpoint", "save"),
    "export_safetensors": ("meshtron.train.hf", "export_safetensors"),
    "init_process_group": ("meshtron.train.lifetime", "init_process_group"),
    "cross_entropy_sum": ("meshtron.train.loss", "cross_entropy_sum"),
    "build_optimizer": ("meshtron.train.optim", "build_optimizer"),
    "forward_backward": ("meshtron.train.step", "forward_backward"),
    "Trainer": ("meshtron.train.trainer", "Trainer"),
}
# the modules that importing the package used to load, with the names above
_SUBMODULES = ("config", "data", "distributed", "models", "train")


__getattr__, __dir__ = lazy(__name__, _HOME, _SUBMODULES)

__all__ = ["AXES", "SUBMESHES", "BatchLoader", "Config", "ParallelConfig", "Trainer", "batch_slice",
           "build_optimizer", "check_pipeline", "clip_grad_norm_", "cross_entropy_sum", "degree",
           "export_safetensors", "forward_backward", "init_mesh", "init_process_group", "latest_checkpoint",
           "load_checkpoint", "load_tokens", "parallelize", "parallelize_module", "save_checkpoint", "split_model",
           "submesh", "user_stages"]
