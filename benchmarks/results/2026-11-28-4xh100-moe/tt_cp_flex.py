"""torchtitan 0.2.2 flavor `tt3_8l_flex`: the peer kit's `tt3_8l` (configs/cp_8l.toml, llama-617M's shape)
with FlexAttention and the block_causal mask (documents split after each end-of-text id of the tokenizer,
causal within each): the flavor arguments of torchtitan's own `debugmodel_flex_attn`. Under context
parallelism torchtitan 0.2.2 applies torch's `_ContextParallel(attention_type=FLEX)` (keys and values
all-gathered, the BlockMask sharded on its query dimension; torchtitan/distributed/context_parallel.py).
Loaded through `--experimental.custom_import tt_cp_flex` with this folder on PYTHONPATH (call.sh); it
registers the kit's flavors first (the kit's config imports them through the same option, which this
one replaces) and only adds an entry to torchtitan's table.
"""
import dataclasses

import tt3_flavors  # noqa: F401  (the kit's flavors: tt3_8l)
from torchtitan.models.llama3 import llama3_args

llama3_args.setdefault("tt3_8l_flex", dataclasses.replace(
    llama3_args["tt3_8l"], attn_type="flex", attn_mask_type="block_causal"))
