"""Data: tokenizers (bytes, Hugging Face tokenizer.json), sources (the standard
library, text, token files, Megatron indexed datasets, weighted blends), the
loader, and `python -m meshtron.data.prepare` to tokenize a corpus."""
from meshtron.data.indexed import IndexedDataset, IndexedDatasetWriter
from meshtron.data.loader import BatchLoader
from meshtron.data.sources import (
                                   Blend,
                                   Tokens,
                                   load_tokens,
                                   open_data,
                                   stdlib_tokens,
                                   text_tokens,
                                   token_file,
                                   write_token_file,
)
from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["BatchLoader", "Blend", "ByteTokenizer", "HFTokenizer", "IndexedDataset", "IndexedDatasetWriter", "Tokens",
           "load_tokenizer", "load_tokens", "open_data", "stdlib_tokens", "text_tokens", "token_file",
           "write_token_file"]
