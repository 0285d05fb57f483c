"""Your own model under meshtron: a transformers Llama built from a config (any
nn.Module with a ModuleList of blocks works the same), sharded 2-way data
parallel with ZeRO-3 x 2-way tensor parallel, trained with meshtron's step,
checkpointed (a second run resumes), and exported as a Hugging Face model.
`--pp 2` cuts it into two pipeline stages before its third block (each stage
runs the model's own forward, with stand-ins for the modules it does not hold).

    meshtron-run --nproc-per-node 4 recipes/own_model.py                 # dp2 x tp2
    meshtron-run --nproc-per-node 4 recipes/own_model.py --pp 2 --tp 1   # dp2 x pp2
"""
import argparse

import torch
import transformers

import meshtron
from meshtron.train.lifetime import one_line_errors

PLAN = {  # module-name globs -> the string styles of meshtron.parallelize_module
    "model.embed_tokens": "vocab_parallel",
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_rep",
}
LAYERS, MICROBATCHES = 4, 4


def pipeline(model, mesh, config, pp):
    """This rank's stages of the model cut into pp stages of equal layer counts, parallelized."""
    meshtron.check_pipeline("1f1b", pp, 1, MICROBATCHES, LAYERS)
    points = [f"model.layers.{LAYERS * s // pp}" for s in range(1, pp)]
    stages, user = meshtron.user_stages(model, "model.layers", points)   # refuses a split that changes the numbers
    pipe = meshtron.split_model(model, mesh, "1f1b", 1, MICROBATCHES, stages, user=user)
    for part in pipe.parts:
        meshtron.parallelize(part, mesh, config, plan=PLAN)
    pipe.build_schedule(meshtron.cross_entropy_sum)
    return pipe


def main():
    parser = argparse.ArgumentParser(description="Train a transformers Llama with meshtron (see the docstring)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (one per pp rank)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp takes the remaining ranks")
    parser.add_argument("--steps", type=int, default=12, help="train to this step")
    parser.add_argument("--checkpoint-dir", help="save the last step here; a later run resumes from it")
    parser.add_argument("--export", help="write the trained weights and config.json here (transformers loads it)")
    parser.add_argument("--hidden-size", type=int, default=128, help="the model's width (another is another model)")
    args = parser.parse_args()
    meshtron.init_process_group(timeout_s=600)
    dp = torch.distributed.get_world_size() // (args.pp * args.tp)
    mesh = meshtron.init_mesh(dp=dp, pp=args.pp, tp=args.tp)
    torch.manual_seed(0)    # every rank builds the same weights, then keeps its shards
    hf_config = transformers.LlamaConfig(
        hidden_size=args.hidden_size, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, use_cache=False)
    model = transformers.LlamaForCausalLM(hf_config)
    config = meshtron.ParallelConfig(zero=3, loss_parallel=False)
    pipe = pipeline(model, mesh, config, args.pp) if args.pp > 1 else None
    if pipe is None:
        meshtron.parallelize(model, mesh, config, plan=PLAN)  # TP, then one FSDP unit per decoder layer
    parts = pipe.parts if pipe else [model]
    names = pipe.param_names() if pipe else None             # checkpoints keep the model's own names
    optimizer = meshtron.build_optimizer(parts, lr=3e-3)
    index, count = meshtron.batch_slice(mesh)                # this rank's slice of each global batch
    loader = meshtron.BatchLoader(meshtron.load_tokens(None, 320), seq_len=32, global_batch=8, dp_rank=index,
                                  dp_size=count)
    start = 0
    if args.checkpoint_dir and meshtron.latest_checkpoint(args.checkpoint_dir):
        start = meshtron.load_checkpoint(meshtron.latest_checkpoint(args.checkpoint_dir), parts, optimizer,
                                         loader=loader, config=hf_config, names=names)  # another model is refused
    rank0 = torch.distributed.get_rank() == 0
    for step in range(start + 1, args.steps + 1):
        x, y = loader.next()
        loss = meshtron.forward_backward(parts, x, y, mesh, zero=config.zero, pipeline=pipe)
        norm = meshtron.clip_grad_norm_([p for m in parts for p in m.parameters()], 1.0, mesh,
                                        pipe.norm_parameters() if pipe else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 3 == 0 and rank0:
            print(f"step {step} | loss {float(loss):.4f} | grad norm {float(norm):.3f}", flush=True)
    if args.checkpoint_dir and args.steps > start:
        path = meshtron.save_checkpoint(args.checkpoint_dir, args.steps, parts, optimizer, loader=loader,
                                        config=hf_config, names=names)
        if rank0:
            print(f"saved checkpoint {path}", flush=True)
    if args.export:
        meshtron.export_safetensors(parts, args.export)   # under the model's own names: transformers' here
        if rank0:
            hf_config.save_pretrained(args.export)
            print(f"exported the weights to {args.export}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    one_line_errors(main)   # a mistake of the user's (another model's checkpoint, a bad path) is one line
