"""The package's shape: distributed/ imports nothing of meshtron outside it, the layers
above it point one way (train/, then planner/, then the command line), nothing imports in a
cycle, model files import no torch.distributed, and the code passes the project's ruff
configuration."""
import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "meshtron")


def modules() -> dict[str, str]:
    """meshtron module name -> file, packages by their __init__.py."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def imports(name: str, path: str, known: dict) -> set[str]:
    """The meshtron modules `name` imports anywhere in its file (lazy imports too).
    `from a import b` names module a.b when it exists, else a; parent packages a
    module implicitly initializes are not counted as its imports."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: resolve against this module's package
                pkg = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known}


def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_distributed_imports_only_distributed():
    # model-agnostic parallelism: no config tree, no model, no trainer, nothing of the
    # package above it (what it needs of a config comes in as arguments or a Protocol)
    found = {name: deps for name, deps in graph().items() if name.startswith("meshtron.distributed.")}
    assert "meshtron.distributed.expert_parallel" in found   # the walk sees the folder
    for name, deps in found.items():
        bad = {d for d in deps if not d.startswith("meshtron.distributed.") and d != "meshtron.distributed"}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_the_code_names_no_dates_and_no_results_file():
    # the code says why; what was measured when is benchmarks/RESULTS.md's (docs/design.md),
    # so a comment or a --help never goes stale with a figure (the calibration data may cite its rows)
    found = [f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}" for path in modules().values()
             for i, line in enumerate(open(path), 1) if re.search(r"20\d\d-\d\d-\d\d|RESULTS|HISTORY", line)]
    assert not found, "\n".join(found)


def test_no_import_cycles():
    g = graph()
    state = {}

    def visit(n, path):
        state[n] = "open"
        for d in sorted(g[n]):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[n] = "done"

    for n in sorted(g):
        if n not in state:
            visit(n, [n])


def test_model_files_are_plain_pytorch():
    for name, path in modules().items():
        if name.startswith("meshtron.models.") and name.endswith(".model"):
            tree = ast.parse(open(path).read())
            names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
            names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            assert not any(n.startswith("torch.distributed") for n in names), (name, names)


def test_ruff():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    assert os.path.exists(ruff), "ruff is not installed (pip install -e '.[test]' installs it)"
    out = subprocess.run([ruff, "check", "meshtron", "tests", "recipes", "benchmarks"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-3000:]


LOWER = ("distributed", "models", "data", "kernels_triton")   # what train/ and planner/ are built on
# above them, bottom to top: the trainer, the planner (which predicts and dry-runs its runs), the command line
LAYERS = ("train", "planner", "cli")


def imported_from_above(package: str, above: tuple[str, ...]) -> dict[str, list[str]]:
    """{module of meshtron.<package>: the modules of the packages `above` it imports}, for every module
    of the package (empty lists where it imports none)."""
    known = modules()
    return {name: sorted(m for m in imports(name, path, known) if m.partition(".")[2].split(".")[0] in above)
            for name, path in known.items() if name.split(".")[1:2] == [package]}


def test_no_lower_package_imports_up_into_train_or_planner():
    # issue 36, point 7: the packages below import nothing from the ones built on them
    up = {}
    for package in LOWER:
        up |= imported_from_above(package, LAYERS)
    assert not {k: v for k, v in up.items() if v}, up
    assert "meshtron.models" in up and "meshtron.distributed.pipeline_parallel" in up   # the walk saw them


def test_train_planner_and_the_command_line_point_one_way():
    # issue 59, point 3: train/ imports neither the planner nor the command line, the planner not the
    # command line; what both need lives below them
    for i, package in enumerate(LAYERS[:-1]):
        up = {k: v for k, v in imported_from_above(package, LAYERS[i + 1:]).items() if v}
        assert not up, f"{package}/ imports from above it: {up}"
    assert "meshtron.train.trainer" in imported_from_above("train", ("planner",))   # the walk saw them
    assert "meshtron.planner.dry_run" in imported_from_above("planner", ("cli",))


def test_the_trainers_file_holds_the_trainer_only():
    # issue 36: the process group's helper is lifetime.py's, the command line cli.py's
    tree = ast.parse(open(os.path.join(PKG, "train", "trainer.py")).read())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined == ["Trainer"], defined


@pytest.mark.slow
def test_importing_meshtron_and_a_transformers_model_prints_nothing():
    # issue 36: torchao's CPU-machine load messages, once per rank, whenever transformers loads a model class
    out = subprocess.run([sys.executable, "-c", "import meshtron; from transformers import LlamaForCausalLM"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out.stderr


def test_tests_start_ranks_only_through_the_harness_pools():
    # a spawned rank ends through the interpreter's teardown, which live gloo threads abort under
    # load (test_dtensor_two_ranks_gloo, SIGABRT after its checks passed); tests/harness.py says why
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and name != "harness.py":
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Attribute) and node.attr in ("spawn", "start_processes", "Process"):
                        found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: .{node.attr}")
    assert not found, found


def test_torchaos_kernel_load_failures_are_dropped_only_without_cuda():
    import logging

    import torch

    import meshtron

    def kept(f, message):
        return f.filter(logging.LogRecord("torchao", logging.WARNING, __file__, 1, message, None, None))

    failed = "Failed to load /site-packages/torchao/_C_cutlass_90a.abi3.so: undefined symbol"
    enum = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile"
    assert not kept(meshtron._ImportNoise(cuda=False), failed) and kept(meshtron._ImportNoise(cuda=True), failed)
    assert not any(kept(meshtron._ImportNoise(cuda=c), enum) for c in (False, True))
    assert kept(meshtron._ImportNoise(cuda=False), "a message about the run")
    installed = [f for f in logging.getLogger("torchao").filters if isinstance(f, meshtron._ImportNoise)]
    assert len(installed) == 1 and kept(installed[0], failed) == torch.cuda.is_available()


def test_the_lazy_names_are_listed_and_load_no_torch():
    # PEP 562: dir() lists the names a package loads on first use, and listing them loads nothing
    code = ("import sys, meshtron, meshtron.models, meshtron.models.gpt, meshtron.models.llama\n"
            "print(all(set(p.__all__) <= set(dir(p)) for p in (meshtron, meshtron.models, meshtron.models.gpt,"
            " meshtron.models.llama)), 'hf' in dir(meshtron.models.gpt), 'torch' in sys.modules)\n"
            "print(meshtron.models.gpt.PRESETS is meshtron.models.gpt.config.PRESETS, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False", "True", "False"], out.stdout


def test_triton_is_an_extra_not_a_dependency():
    # issue 57, point 6: training on the CPU needs no triton (a large download for kernels the CPU never
    # runs); the gpu extra has it for the fused kernels, the test extra for the kernels' interpreter tests
    import re
    import tomllib
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]

    def names(requirements):
        return {re.split(r"[\s<>=!~;\[]", r)[0] for r in requirements}
    assert "triton" not in names(project["dependencies"])
    assert all("triton" in names(project["optional-dependencies"][e]) for e in ("gpu", "test"))


# triton as an install without it has it: not found; each meshtron file that asks for it is recorded
NO_TRITON = """
import os, sys, traceback
asked = []

class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            importer = next(f for f in reversed(traceback.extract_stack()[:-1])
                            if not f.filename.startswith("<frozen importlib"))
            if "/meshtron/" in importer.filename:
                asked.append(f"{importer.filename}:{importer.lineno}")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
import torch, torch.nn.functional as F
from meshtron.cli.train import main
losses = main(["--model", "tiny", "--seq-len", "32", "--steps", "1", "--micro-batch", "2", "--global-batch", "2"])
print(len(losses), asked)
from meshtron.kernels_triton import layer_norm   # asks, and falls back
x, w = torch.randn(4, 8), torch.randn(8)
print(torch.equal(layer_norm(x, w, w, 1e-5), F.layer_norm(x, (8,), w, w, 1e-5)))
"""


@pytest.mark.slow
def test_a_cpu_run_trains_without_triton_and_meshtron_never_asks_for_it():
    # issue 57, point 6: with triton not installed a training step runs, nothing of meshtron asks for
    # triton on the way (the models load the kernels only for CUDA tensors), and the kernels, loaded,
    # take the PyTorch path
    out = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-2:] == ["1 []", "True"], out.stdout[-3000:]
