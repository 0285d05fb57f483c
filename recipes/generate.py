"""Sample from a meshtron checkpoint or a Hugging Face model directory (see meshtron/generate.py).

    python recipes/generate.py --hf DIR --prompt "def main(" --max-new-tokens 64
    torchrun --nproc-per-node 2 recipes/generate.py --tp 2 --checkpoint ck/step-00000100 --prompt-ids 1,2,3 --print-ids
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshtron.generate import main  # noqa: E402
from meshtron.train.lifetime import one_line_errors  # noqa: E402

if __name__ == "__main__":
    one_line_errors(main)   # a world of one without torchrun; a mistake is one line
