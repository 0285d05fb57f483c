"""meshtron: Megatron-style parallel training on one DeviceMesh (dp, pp, cp, tp, ep)."""
from meshtron.mesh import AXES, SUBMESHES, degree, init_mesh, submesh
from meshtron.parallelize import ParallelConfig, parallelize
from meshtron.tensor_parallel import parallelize_module

__all__ = ["AXES", "SUBMESHES", "ParallelConfig", "degree", "init_mesh", "parallelize", "parallelize_module", "submesh"]
