"""meshtron's llama-1B as a torchtitan 0.2.2 flavor with packed documents masked:
`meshtron_llama1b_flex` is `meshtron_llama1b` (meshtron_flavors.py) with torchtitan's
FlexAttention and its block_causal mask (documents split after each end-of-text id
of the tokenizer, causal within each), the flavor arguments of torchtitan's own
`debugmodel_flex_attn` / `8B_flex`. Loaded through `--experimental.custom_import
documents_flavors` (the documents suite); only adds an entry to the table.
"""
import dataclasses

from meshtron_flavors import llama3_args

llama3_args.setdefault("meshtron_llama1b_flex", dataclasses.replace(
    llama3_args["meshtron_llama1b"], attn_type="flex", attn_mask_type="block_causal"))
