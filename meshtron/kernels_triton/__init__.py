"""Fused Triton kernels, forward and backward: bias + GeLU and LayerNorm (GPT),
RMSNorm and SwiGLU's ``silu(gate) * up`` (Llama).

    from meshtron.kernels_triton import bias_gelu, layer_norm, LayerNorm, BiasGeLU
    from meshtron.kernels_triton import rms_norm, RMSNorm, swiglu

Each is a ``torch.library`` custom op with its own autograd formula, so
``torch.compile(fullgraph=True)`` keeps them whole and activation recomputation
simply calls them again. On CUDA tensors they run the Triton kernels; elsewhere
they are exactly ``F.layer_norm`` / ``F.gelu(x + bias)`` / ``F.rms_norm`` /
``F.silu(gate) * up``. ``impl="triton"`` forces the kernels (on the CPU under
``TRITON_INTERPRET=1``, as the tests do), ``impl="torch"`` forces PyTorch.

DTensor activations (sequence or column parallel) are computed on their local
shards with no communication; a replicated parameter's gradient comes back as
``Partial()`` over the mesh axes that shard x's rows. SwiGLU's gate and up must
carry the same placements (any sharding: the op is elementwise).
"""
from .bias_gelu import BiasGeLU, bias_gelu
from .layer_norm import LayerNorm, layer_norm
from .rms_norm import RMSNorm, rms_norm
from .swiglu import swiglu

__all__ = ["bias_gelu", "layer_norm", "LayerNorm", "BiasGeLU", "rms_norm", "RMSNorm", "swiglu"]
