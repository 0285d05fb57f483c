"""The README's real-data commands, run exactly as written (from the repository
root, on the CPU): tokenizer, prepare, train with evaluation, plot, sample."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(title: str) -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split(f"## {title}\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_readme_real_data_commands_run_as_written():
    shutil.rmtree(os.path.join(ROOT, "runs", "real"), ignore_errors=True)
    script = readme_block("Real data")
    assert ".venv/bin/python" in script
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))     # the venv the tests run in
    env = dict(os.environ, PATH=bin_dir + ":" + os.environ["PATH"])
    try:
        out = subprocess.run(["bash", "-e", "-c", script.replace(".venv/bin/", "")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        evals = [float(m) for m in re.findall(r"eval +\d+/60 \| loss ([\d.]+)", out.stdout)]
        assert len(evals) == 3 and evals[-1] < evals[0], out.stdout
        with open(os.path.join(ROOT, "runs", "real", "curves.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert out.stdout.strip().splitlines()[-1].strip(), "no sample"
    finally:
        shutil.rmtree(os.path.join(ROOT, "runs", "real"), ignore_errors=True)
