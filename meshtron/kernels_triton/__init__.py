"""Fused Triton kernels: bias + GeLU and LayerNorm, forward and backward.

    from meshtron.kernels_triton import bias_gelu, layer_norm, LayerNorm, BiasGeLU

Each is a ``torch.library`` custom op with its own autograd formula, so
``torch.compile(fullgraph=True)`` keeps them whole and activation recomputation
simply calls them again. On CUDA tensors they run the Triton kernels; elsewhere
they are exactly ``F.layer_norm`` / ``F.gelu(x + bias)``. ``impl="triton"``
forces the kernels (on the CPU under ``TRITON_INTERPRET=1``, as the tests do),
``impl="torch"`` forces PyTorch.

DTensor activations (sequence or column parallel) are computed on their local
shards with no communication; a replicated parameter's gradient comes back as
``Partial()`` over the mesh axes that shard x's rows.
"""
from .bias_gelu import BiasGeLU, bias_gelu
from .layer_norm import LayerNorm, layer_norm

__all__ = ["bias_gelu", "layer_norm", "LayerNorm", "BiasGeLU"]
