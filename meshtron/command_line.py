"""The command line and --config files of a tree of dataclasses (meshtron/config.py's):
`--micro-batch` is `training.micro_batch`, booleans take `--x` / `--no-x`, choices come
from the field's metadata, and each flag's help is its field's docstring. A TOML file
with the same sections can hold any of it (flags override the file). Like the tree, it
imports no torch: the recipe parses and checks the flags before torch loads.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import tomllib


class ConfigError(ValueError):
    """A value the user gave cannot work; the message names it. Every rank has
    the same config, so every rank raises it (meshtron.distributed.agree)."""
    all_ranks = True


def preset_training(models, preset: str) -> dict:
    """The training settings a preset's family is trained with ({"lr": ..., "warmup": ...});
    empty for an unknown preset or without the registry. `models`: the registry (preset ->
    ModelSpec, meshtron.models.PRESETS) or its torch-free index (preset -> these settings,
    meshtron.models.presets.TRAINING), which the recipe parses with before torch loads."""
    entry = (models or {}).get(preset)
    if entry is None:
        return {}
    return dict(entry) if isinstance(entry, dict) else dict(entry.training.get(preset, {}))


@functools.cache
def _classes(module: str) -> dict[str, ast.ClassDef]:
    """The module's top-level classes, parsed once (inspect.getsource of a class parses the
    whole module again for each)."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The string literal under each field: the attribute docstrings of `cls`."""
    body = _classes(cls.__module__)[cls.__name__].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs


def _type_of(f: dataclasses.Field):
    t = f.type if isinstance(f.type, str) else f.type.__name__
    for name, py in (("int", int), ("float", float), ("str", str)):
        if t.startswith(name):
            return py
    raise TypeError(f"config field {f.name} has a type the command line cannot parse: {t}")


def read_toml(path: str, sections: dict, models=None) -> dict:
    """{field: value} of a config file, every key and type checked against the tree
    (`sections`: section name -> its dataclass)."""
    try:
        with open(path, "rb") as f:
            tree = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    values = {}
    for section, table in tree.items():
        if section not in sections or not isinstance(table, dict):
            raise ConfigError(f"--config {path}: unknown section [{section}]; known: {', '.join(sections)}")
        fields = {f.name: f for f in dataclasses.fields(sections[section])}
        for key, value in table.items():
            if key not in fields:
                raise ConfigError(f"--config {path}: [{section}] has no field {key!r}; known: {', '.join(fields)}")
            f = fields[key]
            kind = bool if f.type in ("bool", bool) else _type_of(f)
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool)) or \
                (kind is float and isinstance(value, int) and not isinstance(value, bool))
            choices = tuple(models) if key == "model" and models else f.metadata.get("choices")
            if not ok or (choices and value not in choices):
                want = f"one of {list(choices)}" if choices else f"a {kind.__name__}"
                raise ConfigError(f"--config {path}: [{section}] {key} = {value!r} must be {want}")
            values[key] = value
    return values


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose mistakes raise ConfigError: one line, which the recipe
    prints once under torchrun (every rank parses the same command line) and hands
    to torchrun's summary, instead of the usage block and exit 2 on every rank."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


# --layout-trials' default; the steps the planner's timings leave out (the first compiles and warms
# up, the second may still: recompiles, caches); a trial's steps (meshtron.cli.trials runs them)
LAYOUT_TRIALS, WARMUP_STEPS = 3, 2
TRIAL_STEPS = WARMUP_STEPS + 3


def parser(sections: dict, description: str | None = None, models=None) -> argparse.ArgumentParser:
    """The flags of every field of `sections` (section name -> its dataclass), and the
    recipe's actions (--config, --print-config, --dry-run, --layout, --layout-trials)."""
    p = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a TOML file with the sections below; flags override it")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as such a file and exit")
    p.add_argument("--dry-run", type=int, default=None, metavar="N", nargs="?", const=0,
                   help="build the layout as each rank of a world of N on this one process (fake process group, "
                        "meta tensors), print each rank's parameter, gradient and optimizer bytes and exit; with "
                        "--layout auto, print the chosen layout and its command for N ranks (default N: the "
                        "launcher's world size) and exit (default: off)")
    p.add_argument("--layout", default=None, choices=("auto",),
                   help="auto: the planner ranks the layouts of this world size, model, --seq-len and "
                        "--global-batch that fit the device's free memory less 10%% (the layout flags given "
                        "constrain them), runs the fastest few a few steps each here (--layout-trials), records "
                        "them for its next plan and trains with the fastest measured (docs/planner.md) "
                        "(default: the layout flags as given)")
    p.add_argument("--layout-trials", type=int, default=None, metavar="N",
                   help=f"--layout auto: the planner's N fastest layouts tried {TRIAL_STEPS} steps each on every "
                        f"rank (timed after the first {WARMUP_STEPS}, which compile and warm up); 0: its first "
                        f"choice, untried (default: {LAYOUT_TRIALS})")
    p.add_argument("--dry-run-ranks", default=None, metavar="R,R,...",
                   help="only these ranks of the dry run (default: all)")
    for section, cls in sections.items():
        group = p.add_argument_group(section)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            # a doc that states its default (the preset's, the device's) says more than the field's None
            help_ = docs[f.name] if "default:" in docs[f.name] else f"{docs[f.name]} (default: {f.default})"
            if f.metadata.get("preset"):   # the preset's own, listed; else the field's default
                by_preset = {m: preset_training(models, m).get(f.name) for m in (models or {})}
                listed = ", ".join(f"{m} {v:g}" for m, v in by_preset.items() if v is not None)
                help_ = f"{docs[f.name]} (default: the preset's: {listed}; else {f.default})"
                group.add_argument(flag, type=_type_of(f), default=None, help=help_)
                continue
            if f.type in ("bool", bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
            else:
                choices = tuple(models) if f.name == "model" and models else f.metadata.get("choices")
                group.add_argument(flag, type=_type_of(f), default=f.default, help=help_, choices=choices)
    return p
