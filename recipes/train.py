"""Train a registered model (meshtron.models: the GPT presets tiny ... 6.7B, the
Llama presets llama-tiny ... llama-8B) under any layout of the one mesh.

    torchrun --nproc-per-node 4 recipes/train.py --model tiny --dp 2 --tp 2 --sp --zero 3 --steps 50
    python recipes/train.py --model tiny --steps 20          # one process

Data: the Python standard library's sources (default), a text file or
directory (--data PATH), or a uint16/uint32 token file (--data file.u16).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# before torch starts: CUDA memory in segments that grow in place, so the reserved peak
# stays near the allocated one (torchtitan's launcher sets the same); a setting of yours wins
if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

from meshtron.cli.train import run  # noqa: E402

if __name__ == "__main__":
    run(sys.argv[1:], description=__doc__)
