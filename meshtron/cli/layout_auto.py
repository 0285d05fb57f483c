"""`--layout auto`: the planner inside the recipe. It ranks the layouts of the job (world size,
model, --seq-len, --global-batch; the layout flags given constrain them) that fit the
device's free memory less MARGIN (`ranked`, with the device's measured rows applied:
meshtron.planner.records). On every rank (`auto`): the free memory agreed (the least), rank
0's plan, then its fastest few candidates tried, each trained a few steps on the machine at
hand by every rank of the job at once (meshtron.cli.trials), a table of them, a row each in
the device's records, and the fastest measured to train with. `dry_run_lines` prints the
choice and its command, running nothing.

Memory comes from the device itself: a GPU's free memory (the least over the ranks), on a
CPU the machine's available memory over its ranks. Time comes from the device's shipped
calibration (h100, h200), else from the nearest one's, and the lines say so.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron import models
from meshtron.cli import trials
from meshtron.command_line import TRIAL_STEPS, WARMUP_STEPS, parser, read_toml
from meshtron.config import SECTIONS, Config, ConfigError
from meshtron.distributed.agree import agree
from meshtron.planner import plan, records
from meshtron.planner.hardware import GPUS, calibration_line
from meshtron.train import lifetime

GiB = 2 ** 30
# the flags --layout auto sets; a user's own value of one constrains its search
LAYOUT_FIELDS = ("dp", "pp", "cp", "tp", "ep", "sp", "zero", "hsdp", "pp_schedule", "pp_virtual", "microbatches",
                 "recompute")
CHOSEN = (*LAYOUT_FIELDS, "micro_batch")
# of the device's free memory, left for what the memory model does not count (the allocator's
# fragmentation, CUDA and NCCL buffers, the host's own use)
MARGIN = 0.1


def local_device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def calibration_of(device: torch.device) -> tuple[str, str]:
    """(the shipped calibration the planner times `device` with, the device it stands in for:
    "" where it is the device's own)."""
    if device.type != "cuda":
        return "h100", "the CPU"
    name = torch.cuda.get_device_name(device)
    for gpu in GPUS:
        if re.search(rf"\b{gpu}\b", name, re.IGNORECASE):
            return gpu, ""
    total = torch.cuda.get_device_properties(device).total_memory
    return min(GPUS, key=lambda g: abs(math.log(GPUS[g].memory_bytes / total))), name


def time_source(gpu: str, missing: str) -> str:
    if not missing:
        return f"the {gpu.upper()}'s calibration"
    if missing == "the CPU":
        return f"the {gpu.upper()}'s calibration (there is no CPU calibration)"
    return f"the {gpu.upper()}'s calibration, the nearest (there is none for the {missing})"


@dataclass(frozen=True)
class Budget:
    """The memory a rank may plan for."""
    free: float | None   # bytes free on the device (the least over the ranks); None: not known, no limit
    said: str            # where `free` was read

    @property
    def limit(self) -> float | None:
        return None if self.free is None else self.free * (1 - MARGIN)

    def line(self, ranks: int, time: str) -> str:
        over = f", the least over {ranks} ranks" if ranks > 1 else ""
        memory = f"no limit ({self.said})" if self.free is None else \
            (f"{self.free / GiB:.1f} GiB a rank{over} ({self.said}), planned to {self.limit / GiB:.1f} GiB "
             f"(a {MARGIN:.0%} margin)")
        return f"layout auto: memory: {memory}; time: {time}"


def read_budget(device: torch.device, local_ranks: int) -> Budget:
    """This rank's device's free memory (MESHTRON_FREE_MEMORY_GIB stands in for it: the tests')."""
    seam = os.environ.get("MESHTRON_FREE_MEMORY_GIB")
    if seam is not None:
        try:
            return Budget(float(seam) * GiB, "set by MESHTRON_FREE_MEMORY_GIB")
        except ValueError:
            raise ConfigError(f"MESHTRON_FREE_MEMORY_GIB={seam!r} must be a number of GiB") from None
    if device.type == "cuda":
        return Budget(torch.cuda.mem_get_info(device)[0], f"free on the {torch.cuda.get_device_name(device)}")
    available = _available_ram()
    if available is None:
        return Budget(None, "a CPU has no device memory, and this machine's available memory is unknown")
    return Budget(available / local_ranks, f"this machine's available memory over its {local_ranks} ranks: a CPU "
                                           "has no device memory")


def _available_ram() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def given_fields(argv: list[str], presets=None) -> list[str]:
    """The CHOSEN fields the command line (or its --config file) sets, whatever their value."""
    unset = object()
    p = parser(SECTIONS, models=presets)
    p.set_defaults(**dict.fromkeys(CHOSEN, unset))
    args, _ = p.parse_known_args(argv)
    found = {f for f in CHOSEN if getattr(args, f) is not unset}
    if args.config:
        found |= set(read_toml(args.config, SECTIONS, presets))
    return [f for f in CHOSEN if f in found]


def _value_of(config: Config, field: str):
    return config.training.micro_batch if field == "micro_batch" else getattr(config.parallel, field)


def _keeps(pred, config: Config, given: list[str]) -> bool:
    """Whether a layout has the values of the given flags."""
    for f in given:
        want = _value_of(config, f)
        if f == "micro_batch":
            ok = pred.micro_batch == want
        elif f == "microbatches":
            ok = pred.microbatches == want
        elif f == "dp" and want == -1:   # what the world size leaves: any
            ok = True
        elif f == "zero" and pred.par.dp * pred.par.cp * pred.par.ep == 1:   # nothing to shard: every stage runs as 1
            ok = True
        else:
            ok = getattr(pred.par, f) == want
        if not ok:
            return False
    return True


def _given_text(config: Config, given: list[str]) -> str:
    out = []
    for f in given:
        value, flag = _value_of(config, f), "--" + f.replace("_", "-")
        out.append((flag if value else f"--no-{flag[2:]}") if isinstance(value, bool) else f"{flag} {value}")
    return " ".join(out)


def _model_config(config: Config):
    spec, preset = models.get(config.model.model)
    return spec, spec.configure(preset, config.model)


def ranked(config: Config, world: int, gpus_per_node: int, gpu: str, budget: Budget, given: list[str],
           rows: list[dict], device: str) -> tuple[list, str | None]:
    """(the layouts of the job that keep the given flags and fit the budget, fastest first, with
    the device's measured rows applied; the line that says how the rows were applied, or None).
    Nothing that fits is one line: the smallest layout's need and the budget."""
    par, tr = config.parallel, config.training
    if tr.global_batch is None:
        raise ConfigError("--layout auto needs --global-batch (samples per step), to split it over the ranks")
    _, cfg = _model_config(config)
    fit, over = plan.plan(config.model.model, tr.seq_len, tr.global_batch, world, min(gpus_per_node, world), gpu,
                          compile=par.compile, fp8=par.fp8, cfg=cfg, dtype=par.dtype)
    every = [p for p in fit + over if _keeps(p, config, given)]
    job = f"{config.model.model} at global batch {tr.global_batch} x {tr.seq_len} on {world} ranks"
    if not every:
        raise ConfigError(f"--layout auto: none of the {len(fit + over)} layouts the planner finds for {job} has "
                          f"{_given_text(config, given)}: change or leave out one of those flags")
    every, note = records.correct(every, rows, config, world, gpus_per_node, plan.hardware(gpu), device)
    limit = math.inf if budget.limit is None else budget.limit
    fitting = sorted((p for p in every if p.memory <= limit), key=lambda p: (p.step_s, p.memory))
    if not fitting:
        smallest = min(every, key=lambda p: p.memory)
        kept = f" with {_given_text(config, given)}" if given else ""
        raise ConfigError(f"--layout auto: no layout of {job}{kept} fits {limit / GiB:.1f} GiB a rank "
                          f"({budget.said}: {budget.free / GiB:.1f} GiB, less {MARGIN:.0%}); the smallest needs "
                          f"{smallest.memory / GiB:.1f} GiB ({smallest.flags()}): more GPUs, a smaller global batch "
                          "or sequence")
    return fitting, note


def configured(config: Config, pred) -> Config:
    """`config` with a planned layout's flags."""
    par = dataclasses.replace(config.parallel, **{f: getattr(pred.par, f) for f in LAYOUT_FIELDS})
    return dataclasses.replace(config, parallel=par,
                               training=dataclasses.replace(config.training, micro_batch=pred.micro_batch))


def choice_line(pred, world: int, gpu: str, config: Config) -> str:
    ep = pred.par.degrees()["ep"] > 1
    estimate = ("; expert parallelism's exposed all-to-alls are outside the step model: the trials are the "
                "measure") if ep else ""
    return (f"layout auto: {pred.flags()} on {world} ranks: predicted {pred.step_s * 1e3:.1f} ms a step, "
            f"{pred.memory / GiB:.1f} GiB on the fullest rank (calibration {calibration_line(gpu)}){estimate}")


def dry_run_lines(config: Config, argv: list[str], world: int, gpus_per_node: int, presets=None) -> list[str]:
    """`--layout auto --dry-run`: the budget, the choice and the command that runs it (no trials:
    nothing runs), planned with this machine's device."""
    device = local_device()
    config = config.on_device(device.type)
    gpu, missing = calibration_of(device)
    budget = read_budget(device, gpus_per_node)
    fit, note = ranked(config, world, gpus_per_node, gpu, budget, given_fields(argv, presets),
                       records.read(device_name(device)), device_name(device))
    return [budget.line(1, time_source(gpu, missing)), *([f"layout auto: {note}"] if note else []),
            choice_line(fit[0], world, gpu, config), command_line(argv, fit[0], world, presets)]


def command_line(argv: list[str], pred, world: int, presets=None) -> str:
    """The command `--layout auto` would run: the user's flags but --layout's own and those the
    layout names, then the layout's: each flag once."""
    chosen = pred.flags()
    names = {t for t in chosen.split() if t.startswith("--")} | {"--layout", "--layout-trials", "--dry-run",
                                                                   "--dry-run-ranks"}
    actions = parser(SECTIONS, models=presets)._option_string_actions   # each flag's action, by its spellings
    keep, i = [], 0
    while i < len(argv):
        token = argv[i]
        name, eq, _ = token.partition("=")
        matches = {a for s, a in actions.items() if s == name} or \
            {a for s, a in actions.items() if s.startswith(name) and name.startswith("--")}   # argparse's abbreviations
        action = next(iter(matches)) if len(matches) == 1 else None
        i += 1
        if action is None or not names & set(action.option_strings):
            keep.append(token)
            continue
        if not eq and action.nargs is None or action.nargs == "?" and not eq and i < len(argv) and \
                not argv[i].startswith("-"):
            i += 1   # its value
    return " ".join(["meshtron-run --nproc-per-node", str(world), "recipes/train.py", *keep, chosen])


def auto(config: Config, argv: list[str], tries: int, presets=None, say=None) -> tuple[Config, object]:
    """`--layout auto` on every rank of the job (the process group started): (the config with the
    layout to train with, its Prediction). Rank 0 plans and says; every rank runs the `tries`
    fastest as trials (none: the prediction alone)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = local_device()
    config = config.on_device(device.type)
    gpu, missing = calibration_of(device)
    name = device_name(device)
    say = _silent if rank != 0 else say or functools.partial(print, flush=True)
    found = [None]
    with agree():   # a problem of rank 0's plan (nothing fits) or of a rank's memory stops every rank, in one line
        fail = trials.planted_failure()
        budget = read_budget(device, local)
    budget = _least(budget)
    with agree():
        if rank == 0:
            found[0] = ranked(config, world, local, gpu, budget, given_fields(argv, presets), records.read(name),
                              name)
    dist.broadcast_object_list(found, src=0)   # one plan: each host's records may differ
    fit, note = found[0]
    say(budget.line(world, time_source(gpu, missing)))
    if note:
        say(f"layout auto: {note}")
    candidates = fit[:tries]
    why_not = "--layout-trials 0" if tries == 0 else trials.why_not(world, lifetime.unguarded_main())
    if why_not:
        say(choice_line(fit[0], world, gpu, config) + f"; no trials ({why_not}): the prediction alone")
        return configured(config, fit[0]), fit[0]
    outcomes = [_within(o, budget) for o in trials.run(
        [trials.trial_config(configured(config, p), TRIAL_STEPS) for p in candidates], WARMUP_STEPS, fail)]
    for line in trials.table(candidates, outcomes):
        say(line)
    recorded = ""
    if rank == 0:
        source = (f"meshtron --layout auto trial, {name}, torch {torch.__version__}, the median of "
                  f"{TRIAL_STEPS - WARMUP_STEPS} steps after {WARMUP_STEPS}, {datetime.date.today().isoformat()}")
        rows = [records.row(config, p, world, local, o.step_s, o.peak_gib, source, o.error)
                for p, o in zip(candidates, outcomes)]
        try:
            recorded = f"; recorded in {records.append(name, rows)}"
        except OSError as e:   # a read-only home: the run goes on, unrecorded
            recorded = f"; not recorded ({e})"
    measured = [(o.step_s, i) for i, o in enumerate(outcomes) if o.error is None]
    if not measured:
        error = ConfigError(f"--layout auto: no trial ran within the budget (the first: {outcomes[0].error}); "
                            "--layout-trials 0 trains with the prediction alone")
        error.all_ranks = True   # every rank has every outcome
        raise error
    step_s, best = min(measured)
    say(choice_line(candidates[best], world, gpu, config) +
        f"; measured {step_s * 1e3:.1f} ms, the fastest of {len(measured)} trials{recorded}")
    return configured(config, candidates[best]), candidates[best]


def _silent(line: str) -> None:
    pass


def _least(budget: Budget) -> Budget:
    """The least free memory over the ranks: every rank plans the same layout."""
    free = torch.tensor([math.inf if budget.free is None else budget.free], dtype=torch.float64)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return Budget(None if math.isinf(free.item()) else free.item(), budget.said)


def _within(outcome: trials.Outcome, budget: Budget) -> trials.Outcome:
    """A trial whose measured peak passed the budget is not chosen, however fast: the prediction that
    let it in was short, and the run would be as close to the edge for all its steps."""
    limit, peak = budget.limit, outcome.peak_gib
    if outcome.error is not None or limit is None or peak is None or peak * GiB <= limit:
        return outcome
    return dataclasses.replace(outcome, error=f"over the budget: a peak of {peak:.2f} GiB, {limit / GiB:.2f} GiB "
                                              "planned to")
