"""The documentation is tested: every ```bash block of README.md and docs/*.md runs
as written on the CPU, and every link, path, meshtron name and --flag it mentions
exists.

How a block is run (see docs/testing.md):
- from a scratch directory per page, which holds links to the checkout's top-level
  entries (recipes/, benchmarks/, ...), so a page's blocks run in order and share
  their outputs (a later block resumes an earlier one's checkpoint);
- the commands run as written: `.venv` in the scratch directory is the test's own
  environment, and that environment's bin/ is taken off PATH, so a bare `python`
  or `meshtron-run` fails here as it does in a shell that did not activate it;
  the checkout is first on PYTHONPATH;
- the fence's attributes shorten it: ```bash steps=N runs every `--steps M` as
  `--steps N`; check=NAME runs CHECKS[NAME] on its output and directory;
- a first line `# gpu: why` or `# cluster: why` marks a block that needs a GPU or
  several machines: it is skipped, and its test id says so;
- set-up steps (creating .venv, pip install) are dropped: the test runs in an
  installed venv; README's test command is not run here but compared with .ci/run,
  which runs it verbatim.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import glob
import importlib
import io
import os
import re
import runpy
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # `python -m benchmarks`, whose --help the flag checks read
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
CHECKED = PAGES + ["benchmarks/RESULTS.md"]   # links, paths, names and flags
SKIP_MARKERS = {"gpu": "needs a GPU", "cluster": "needs several machines"}
TOP_LEVEL = ("meshtron/", "tests/", "benchmarks/", "recipes/", "docs/", ".ci/")
BIN = os.path.dirname(os.path.abspath(sys.executable))


@dataclass
class Block:
    page: str
    line: int
    text: str
    attrs: dict = field(default_factory=dict)

    @property
    def marker(self) -> str | None:
        m = re.match(r"#\s*(\w+):", self.text)
        return m.group(1) if m and m.group(1) in SKIP_MARKERS else None

    @property
    def ci(self) -> bool:
        """The test suite's own command (README's), which .ci/run runs: compared with it, not run here."""
        return " -m pytest" in self.text


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def code_blocks(page: str, lang: str = "bash") -> list[Block]:
    out = []
    for m in re.finditer(r"^```(\S*)([^\n]*)\n(.*?)^```", read(page), re.S | re.M):
        if m.group(1) == lang:
            attrs = dict(a.split("=", 1) for a in m.group(2).split())
            out.append(Block(page, read(page)[:m.start()].count("\n") + 1, m.group(3), attrs))
    return out


def block_id(b: Block) -> str:
    kind = b.marker or ("ci" if b.ci else "run")
    return f"{b.page}:{b.line}-{kind}"


ALL_BLOCKS = [b for page in PAGES for b in code_blocks(page)]


# ---------------------------------------------------------------- running the blocks

def real_data(stdout: str, cwd: str) -> None:
    """docs/data.md's walk-through: evaluation falls, the plot is a PNG, a sample is printed."""
    evals = [float(m) for m in re.findall(r"eval +\d+/60 \| loss ([\d.]+)", stdout)]
    assert len(evals) == 3 and evals[-1] < evals[0], stdout
    with open(os.path.join(cwd, "runs", "real", "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    after = stdout[stdout.rindex("\ndone: "):]                  # training's closing line, then the plot and the sample
    sample = after[after.index("\ndef ") + 1:]                   # the prompt, then what the model wrote
    assert len("".join(sample[4:].split())) >= 10, f"no sample: {sample!r}"


def resumed(stdout: str, cwd: str) -> None:
    """docs/checkpoints.md: the second run resumed (under another layout) instead of starting again."""
    assert "resumed" in stdout.lower(), stdout[-3000:]
    assert os.path.exists(os.path.join(cwd, "out", "gpt2", "config.json"))


def own_model(stdout: str, cwd: str) -> None:
    """docs/own-model.md: six steps at dp2 x tp2, resumed at dp2 x pp2 to twelve, exported and read by transformers."""
    steps = re.findall(r"^step (\d+) \| loss ([\d.]+)", stdout, re.M)
    assert [int(s) for s, _ in steps] == [3, 6, 9, 12], stdout
    assert float(steps[-1][1]) < float(steps[0][1]) - 0.5, stdout
    assert "saved checkpoint runs/own/step-00000012" in stdout and "LlamaForCausalLM" in stdout, stdout


def dry_run_64(stdout: str, cwd: str) -> None:
    """docs/planner.md: each named rank's bytes and one step's collectives (FSDP's reduce-scatter,
    SP's all-gathers) equal the planner's, at 64 ranks."""
    rows = [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 63] and all(r[-1] == "equal" for r in rows), stdout
    counted = [line for line in stdout.splitlines() if line.startswith("  rank ")]
    assert [int(c.split()[1].rstrip(":")) for c in counted] == [0, 63], stdout
    assert all("reduce_scatter over" in c and "all_gather over tp" in c and c.endswith("planner equal")
               for c in counted), stdout


CHECKS = {"real_data": real_data, "resumed": resumed, "own_model": own_model, "dry_run_64": dry_run_64}


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    dirs = {}

    def get(page: str) -> str:
        if page not in dirs:
            d = tmp_path_factory.mktemp(re.sub(r"\W", "_", page))
            for name in os.listdir(ROOT):
                if name not in (".git", ".venv", "runs") and not name.startswith(".pytest"):
                    os.symlink(os.path.join(ROOT, name), d / name)
            venv(d / ".venv")
            dirs[page] = str(d)
        return dirs[page]
    return get


def venv(link) -> None:
    """`link` as the pages' `.venv`: the environment this test runs in (its bin/ alone
    where the interpreter is not a venv's)."""
    if sys.prefix != sys.base_prefix:
        os.symlink(sys.prefix, link)
    else:
        os.mkdir(link)
        os.symlink(BIN, os.path.join(link, "bin"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


INSTALL = re.compile(r"python3 -m venv \S+|\S*pip install .*")


def without_install(text: str) -> str:
    """A command line less its set-up steps (creating .venv, pip install): the test runs in an installed venv."""
    return " && ".join(p for p in text.strip().split(" && ") if not INSTALL.fullmatch(p.strip()))


def as_run(b: Block) -> str:
    script = without_install(b.text)
    if "steps" in b.attrs:
        script = re.sub(r"--steps \d+", f"--steps {b.attrs['steps']}", script)
    return script


def run_params():
    for b in ALL_BLOCKS:
        marks = [pytest.mark.skip(reason=f"{SKIP_MARKERS[b.marker]}: {b.text.splitlines()[0]}")] if b.marker else []
        if not b.ci:
            yield pytest.param(b, id=block_id(b), marks=marks)


def run_block(block: Block, cwd: str) -> subprocess.CompletedProcess:
    path = [d for d in os.environ["PATH"].split(os.pathsep) if os.path.abspath(d) != BIN]
    env = dict(os.environ, PATH=os.pathsep.join(path), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)    # conftest's, for the kernels' tests; the commands run as a user's would
    port = str(free_port())              # torchrun's and the one-process recipe's default ports may be taken
    env.update(PET_MASTER_PORT=port, MASTER_PORT=port)
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", as_run(block)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def block_runs(request, workdirs):
    """The runs of the blocks this session selected, started at once: each page's blocks in
    order in its directory, two pages at a time. Most commands keep one core busy (a
    one-process recipe, the tokenizer, the planner's fit), so one block at a time left the
    other core idle for most of the module. Returns a block's finished run."""
    chosen = [item.callspec.params["block"] for item in request.session.items
              if item.originalname == "test_block_runs" and not item.get_closest_marker("skip")]
    pages: dict[str, list[Block]] = {}
    for b in chosen:
        pages.setdefault(b.page, []).append(b)
    cwds = {page: workdirs(page) for page in pages}
    runs = {(b.page, b.line): concurrent.futures.Future() for b in chosen}

    def run_page(page: str) -> None:
        for b in pages[page]:
            run = runs[b.page, b.line]
            try:
                run.set_result(run_block(b, cwds[page]))
            except BaseException as e:  # noqa: BLE001 - the block's test raises it
                run.set_exception(e)

    pool = concurrent.futures.ThreadPoolExecutor(2)
    for page in pages:
        pool.submit(run_page, page)
    yield lambda b: runs[b.page, b.line].result()
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("block", list(run_params()))
@pytest.mark.slow
def test_block_runs(block: Block, block_runs, workdirs):
    out = block_runs(block)
    assert out.returncode == 0, f"{block_id(block)}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    if "check" in block.attrs:
        CHECKS[block.attrs["check"]](out.stdout, workdirs(block.page))


# a program given arguments where a command starts: a line's start, after env assignments,
# &&, ||, |, ; or $( (a name alone, `meshtron-run`, is prose)
COMMAND = re.compile(r"(?:^|&&|\|\||\||;|\$\()\s*(?:[A-Z_]+=\S*\s+)*(?<![\w/.-])"
                     r"(python3?|pip|torchrun|meshtron-run)(?=\s+\S)")


@pytest.mark.parametrize("page", PAGES)
def test_commands_use_the_venv_as_readme_makes_it(page):
    # README creates .venv and does not activate it: a bare `python` is then another Python
    # (No module named 'torch'), `meshtron-run` is not found. Blocks and `inline` commands alike.
    lines = [ln for b in code_blocks(page) for ln in b.text.splitlines()] + code_spans(page)
    bare = [ln for ln in lines for m in COMMAND.finditer(ln) if not ln[m.start(1):].startswith("python3 -m venv ")]
    assert not bare, f"{page}: commands without .venv/bin/: {bare}"


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_are_files_the_page_runs(page):
    # a page's Python is a file of the checkout, shown whole, which one of its commands runs
    runs = " ".join(b.text for b in code_blocks(page) if not b.marker)
    for b in code_blocks(page, "python"):
        path = b.attrs.get("file")
        assert path, f"{page}:{b.line}: a ```python block names the file it shows (file=PATH)"
        assert b.text == read(path), f"{page}:{b.line}: the block differs from {path}"
        assert path in runs, f"{page}:{b.line}: no command of the page runs {path}"


def test_readme_says_how_often_a_run_logs():
    # issue 57, point 6: it said "logs each step", of a run that logs every --log-interval steps
    from meshtron.config import TrainingConfig
    said = re.search(r"The run logs its first step, every (\d+)th \(`--log-interval`\) and its last",
                     " ".join(prose("README.md").split()))
    assert said and int(said.group(1)) == TrainingConfig.log_interval


def test_readme_set_up_is_what_ci_runs():
    ci = [ln for ln in read(".ci/run").splitlines() if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    readme = code_blocks("README.md")
    assert [b.text.strip() for b in readme if b.ci] == ci, "README's test command is .ci/run's, verbatim"
    train = readme[0].text.strip()
    install = train[:len(train) - len(without_install(train))].replace(" -q", "")
    # less the test extras: training needs none of them
    assert install and ci[0].replace(" -q", "").replace("-e '.[test]'", "-e .").startswith(install), \
        "README's first command installs as CI does"


# ---------------------------------------------------------------- links, paths, names

def prose(page: str) -> str:
    return re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)


def slug(heading: str) -> str:
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


@pytest.mark.parametrize("page", CHECKED)
def test_links_resolve(page):
    here = os.path.dirname(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(ROOT, page)
        assert os.path.exists(full), f"{page}: link to {target}: no such file"
        if anchor and full.endswith(".md"):
            with open(full) as f:
                anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", f.read(), re.M)}
            assert anchor in anchors, f"{page}: link to {target}: no such heading"


def code_spans(page: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(page))


@pytest.mark.parametrize("page", CHECKED)
def test_paths_exist(page):
    for span in code_spans(page) + [w for b in code_blocks(page) for w in b.text.split()]:
        for word in span.split():
            word = word.split("::")[0].rstrip(".,;:)")
            if word.startswith(TOP_LEVEL) and not re.search(r"[$<{]", word):
                assert glob.glob(os.path.join(ROOT, word)), f"{page}: {word} does not exist"


def test_the_tree_lists_real_files():
    """docs/design.md's tree of the code: every entry (the first word of each line) exists."""
    tree = next(b.text for b in code_blocks("docs/design.md", "text") if b.text.startswith("meshtron/"))
    folders: list[tuple[int, str]] = []
    for line in tree.splitlines():
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        folders = [(i, f) for i, f in folders if i < indent]
        path = os.path.join(*[f for _, f in folders], name)
        assert os.path.exists(os.path.join(ROOT, path)), f"docs/design.md lists {path}, which does not exist"
        if name.endswith("/"):
            folders.append((indent, name))


def resolve(name: str) -> None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return
    raise ImportError(name)


@pytest.mark.parametrize("page", CHECKED)
def test_meshtron_names_resolve(page):
    for span in code_spans(page):
        for name in re.findall(r"\bmeshtron(?:\.\w+)+", span):
            if not name.endswith((".json", ".py", ".md")):
                try:
                    resolve(name)
                except (ImportError, AttributeError) as e:
                    pytest.fail(f"{page}: `{span}` names {name}, which does not resolve: {e}")


# ---------------------------------------------------------------- flags

PROGRAMS = {  # how a command line names a program -> how to ask it for its help (run in this process)
    "recipes/train.py": "trainer",
    "recipes/generate.py": "recipes/generate.py",
    "recipes/own_model.py": "recipes/own_model.py",
    "meshtron.plan calibrate": ("meshtron.plan", "calibrate"),
    "meshtron.plan": ("meshtron.plan",),
    "meshtron.data.prepare": ("meshtron.data.prepare",),
    "meshtron.data.train_tokenizer": ("meshtron.data.train_tokenizer",),
    "meshtron.plot": ("meshtron.plot",),
    "benchmarks/bench_train.py": "benchmarks/bench_train.py",
    "benchmarks/bench_plan.py": "benchmarks/bench_plan.py",
    "benchmarks/bench_cp.py": "benchmarks/bench_cp.py",
    "benchmarks/bench_moe.py": "benchmarks/bench_moe.py",
    "benchmarks/bench_documents.py": "benchmarks/bench_documents.py",
    "benchmarks/bench_kernels.py": "benchmarks/bench_kernels.py",
    "benchmarks/bench_fused_loss.py": "benchmarks/bench_fused_loss.py",
    "benchmarks/bench_checkpoint.py": "benchmarks/bench_checkpoint.py",
    "benchmarks/moe_balance.py": "benchmarks/moe_balance.py",
    "benchmarks/check_ce_reduce_scatter.py": None,   # no flags
    "benchmarks run": ("benchmarks", "run"),
    "benchmarks report": ("benchmarks", "report"),
    "benchmarks/compare_grads.py": "docstring",    # no --help: its flags are in its docstring
    "torchrun": "torchrun",   # and meshtron-run, which takes torchrun's flags
}
PASSES_TO_TRAINER = ("benchmarks/bench_train.py", "benchmarks/bench_plan.py", "benchmarks/compare_grads.py",
                     "benchmarks/moe_balance.py", "benchmarks/bench_checkpoint.py")


def help_text(program: str) -> str:
    how = PROGRAMS[program]
    if how == "trainer":
        from meshtron.command_line import parser
        from meshtron.config import SECTIONS
        return parser(SECTIONS).format_help()
    if how == "torchrun":
        from torch.distributed.run import get_args_parser
        return get_args_parser().format_help()
    if how == "docstring":
        return read(program).split('"""')[1]
    argv = [program] + list(how[1:]) + ["--help"] if isinstance(how, tuple) else [how, "--help"]
    out, old_argv = io.StringIO(), sys.argv
    try:
        sys.argv = argv
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # runpy: the module is imported already
            if isinstance(how, tuple):
                runpy.run_module(how[0], run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(os.path.join(ROOT, how), run_name="__main__")
    finally:
        sys.argv = old_argv
    return out.getvalue()


@functools.cache
def flags_of(program: str) -> frozenset:
    if PROGRAMS[program] is None:
        return frozenset()
    flags = set(re.findall(r"--[a-z][\w-]*", help_text(program)))
    assert flags, f"{program} --help printed no flags"
    if program in PASSES_TO_TRAINER:
        flags |= flags_of("recipes/train.py")
    return frozenset(flags)


def commands(text: str):
    """(program, flags) of every command in a shell block; the flags are those after the program's name."""
    text = re.sub(r"\\\n\s*", " ", text)
    text = re.sub(r"\"[^\"]*\"|'[^']*'", "''", text)     # quoted strings are values, not flags
    for line in text.splitlines():
        for cmd in re.split(r"&&|\|\||;|\|", line.split("#")[0]):
            names = [p for p in PROGRAMS if p != "torchrun" and re.search(rf"(^|[\s/-]){re.escape(p)}(\s|$)", cmd)]
            name = max(names, key=len) if names else None
            if re.search(r"(^|[\s/])(torchrun|torch\.distributed\.run|meshtron-run|meshtron\.launch)\s", cmd):
                yield "torchrun", re.findall(r"(?<!\S)--[a-z][\w-]*", cmd.split(name)[0] if name else cmd)
            if name:
                yield name, re.findall(r"(?<!\S)--[a-z][\w-]*", cmd.split(name, 1)[1])


@pytest.mark.parametrize("page", CHECKED)
def test_command_flags_exist(page):
    for b in code_blocks(page):
        for program, flags in commands(b.text):
            known = flags_of(program)
            if known:
                missing = [f for f in flags if f.split("=")[0] not in known]
                assert not missing, f"{page}:{b.line}: {program} has no {missing}"


@pytest.mark.parametrize("page", CHECKED)
def test_prose_flags_exist(page):
    """A --flag named in the text is the trainer's, or one of the documented tools' (torchrun, the planner,
    the benchmarks, the data tools)."""
    known = set().union(*(flags_of(p) for p in PROGRAMS))
    missing = sorted({f for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", prose(page)) if f not in known})
    assert not missing, f"{page}: no program documented here has {missing}"
