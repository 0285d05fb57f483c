"""The former name of recipes/train.py (the GPT presets keep their names there)."""
import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), run_name="__main__")
