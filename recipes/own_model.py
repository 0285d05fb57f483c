"""Your own model under meshtron: a transformers Llama built from a config (any
nn.Module with a ModuleList of blocks works the same), sharded 2-way data
parallel with ZeRO-3 x 2-way tensor parallel, trained with meshtron's step.

    torchrun --nproc-per-node 4 recipes/own_model.py
"""
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meshtron  # noqa: E402
from meshtron.data import BatchLoader, load_tokens  # noqa: E402
from meshtron.distributed.mesh import batch_slice  # noqa: E402
from meshtron.distributed.reduce import clip_grad_norm_  # noqa: E402
from meshtron.optim import build_optimizer  # noqa: E402
from meshtron.step import forward_backward  # noqa: E402
from meshtron.trainer import init_process_group  # noqa: E402

PLAN = {  # module-name globs -> the string styles of meshtron.parallelize_module
    "model.embed_tokens": "vocab_parallel",
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_rep",
}


def main():
    init_process_group(600)
    mesh = meshtron.init_mesh(dp=2, tp=2)
    torch.manual_seed(0)    # every rank builds the same weights, then keeps its shards
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, max_position_embeddings=256, use_cache=False))
    config = meshtron.ParallelConfig(zero=3, loss_parallel=False)
    meshtron.parallelize(model, mesh, config, plan=PLAN)     # TP, then one FSDP unit per decoder layer
    optimizer = build_optimizer(model, lr=3e-3)
    index, count = batch_slice(mesh)                         # this rank's slice of each global batch
    loader = BatchLoader(load_tokens(None, 320), seq_len=32, global_batch=8, dp_rank=index, dp_size=count)
    for step in range(1, 13):
        x, y = loader.next()
        loss = forward_backward([model], x, y, mesh, zero=config.zero)
        norm = clip_grad_norm_(model.parameters(), 1.0, mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 3 == 0 and torch.distributed.get_rank() == 0:
            print(f"step {step} | loss {float(loss):.4f} | grad norm {float(norm):.3f}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
