"""meshtron: Megatron-style parallel training on one DeviceMesh (dp, pp, cp, tp, ep)."""
from meshtron.config import Config, ParallelConfig
from meshtron.distributed.mesh import AXES, SUBMESHES, degree, init_mesh, submesh
from meshtron.distributed.parallelize import parallelize
from meshtron.distributed.tensor_parallel import parallelize_module
from meshtron.train.trainer import Trainer

__all__ = ["AXES", "SUBMESHES", "Config", "ParallelConfig", "Trainer", "degree", "init_mesh", "parallelize",
           "parallelize_module", "submesh"]
