"""The planner (issue 17): its per-rank parameter, gradient and optimizer bytes
equal what each rank of a real run holds after a step, under every axis, and
its enumeration ranks every layout of 64 GPUs (its speed: benchmarks/bench_plan.py
--planner-speed; a timing is no test on a shared machine)."""
import dataclasses
import json
import os
import re

import pytest
import torch
from torch.distributed.tensor import DTensor

from meshtron import models
from meshtron.config import ParallelConfig
from meshtron.distributed.mesh import resolve_degrees
from meshtron.planner import cli, plan

from harness import DryRuns, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fp32: the real runs beside the dry runs are CPU ones (the dry run alone would stand for a GPU's bf16)
ARGS = ["--seq-len", "16", "--steps", "1", "--log-interval", "1", "--max-norm", "1.0", "--dtype", "fp32"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _measured_and_predicted(rank, world, argv):
    from meshtron.config import Config
    from meshtron.distributed.collectives import CollectiveCounter
    from meshtron.models import PRESETS
    from meshtron.train.trainer import Trainer
    trainer = Trainer(Config.from_args(argv, models=PRESETS), verbose=False)
    params = list({id(p): p for part in trainer.parts for p in part.parameters()}.values())
    grads = []   # what the optimizer steps on (the trainer frees gradients after the step)
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(
        sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)))
    trainer.train()
    with CollectiveCounter(trainer.mesh) as count:   # a step after the first, as the dry run counts
        trainer.step(*trainer.loader.next())
    measured = {
        "params": sum(_local(p).numel() * p.element_size() for p in params),
        "grads": grads[0],
        "optim": sum(_local(v).numel() * v.element_size() for s in trainer.optimizer.state.values()
                     for v in s.values() if torch.is_tensor(v)),
    }
    par = dataclasses.replace(trainer.config.parallel, **resolve_degrees(world, **trainer.config.parallel.degrees()))
    tr = trainer.config.training
    calls, nbytes = plan.step_collectives(trainer.spec, trainer.model_config, par, tr.micro_batch,
                                          trainer.microbatches, tr.seq_len, rank, device="cpu")
    named = lambda counts: {" ".join(k): v for k, v in counts.items()}  # noqa: E731
    return measured, plan.state_bytes(trainer.spec, trainer.model_config, par, rank), \
        (named(count.bytes), named(count.calls)), (named(nbytes), named(calls))


LAYOUTS = {
    2: [["--model", "tiny", "--dp", "2", "--zero", "3"],
        ["--model", "tiny", "--tp", "2", "--sp"],
        ["--model", "llama-tiny", "--pp", "2", "--global-batch", "4", "--micro-batch", "1"],
        ["--model", "llama-moe-tiny", "--ep", "2", "--zero", "2"],
        ["--model", "llama-tiny", "--tp", "2", "--sp", "--tp-overlap"],
        ["--model", "llama-tiny", "--tp", "2", "--sp", "--tp-overlap", "--tp-overlap-comm", "chunked"],
        ["--model", "llama-moe-tiny", "--ep", "2", "--zero", "2", "--moe-dispatch", "padded"],
        ["--model", "llama-moe-tiny", "--ep", "2", "--moe-two-batch", "--recompute", "full"]],
    4: [["--model", "tiny", "--dp", "2", "--tp", "2", "--sp", "--zero", "3"],
        ["--model", "llama-tiny", "--dp", "4", "--zero", "0"],
        ["--model", "llama-tiny", "--dp", "4", "--hsdp", "2", "--zero", "2"],
        ["--model", "tiny", "--dp", "2", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual", "2",
         "--global-batch", "8", "--micro-batch", "2"],
        ["--model", "llama-tiny", "--cp", "2", "--tp", "2", "--dtype", "bf16"],
        ["--model", "llama-moe-tiny", "--dp", "2", "--ep", "2", "--zero", "3"],
        ["--model", "tiny", "--pp", "2", "--pp-schedule", "zbv", "--pp-virtual", "2", "--tp", "2",
         "--global-batch", "4", "--micro-batch", "1"]],
    8: [["--model", "tiny", "--dp", "2", "--pp", "2", "--tp", "2", "--sp", "--zero", "3", "--global-batch", "8",
         "--micro-batch", "2"],
        ["--model", "llama-moe-tiny", "--dp", "2", "--cp", "2", "--ep", "2", "--zero", "1"]],
}

# layouts the dry run alone plays (it counts what gloo counts for the layouts above): the
# planner's collectives against it under recompute, bf16 with accumulation, the other CP
# variants, DDP over two axes, MoE with TP, capacity or a pipeline, two-batch overlap under
# ZeRO-3 (one gather of each block and its experts for both halves), the fused loss under tp
# (one all-gather per chunk), tp4's chunked overlap recomputed
DRY_ONLY = {
    2: [["--model", "llama-moe-tiny", "--dp", "2", "--moe-capacity", "1.25"],
        ["--model", "tiny", "--tp", "2", "--fused-loss", "--global-batch", "4", "--micro-batch", "1"]],
    4: [["--model", "tiny", "--dp", "2", "--tp", "2", "--sp", "--zero", "3", "--recompute", "full"],
        ["--model", "tiny", "--dp", "2", "--tp", "2", "--sp", "--zero", "2", "--recompute", "selective",
         "--microbatches", "2"],
        ["--model", "llama-tiny", "--dp", "2", "--tp", "2", "--sp", "--zero", "1", "--dtype", "bf16",
         "--microbatches", "2"],
        ["--model", "llama-tiny", "--dp", "2", "--tp", "2", "--sp", "--zero", "3", "--dtype", "bf16",
         "--fused-loss"],
        ["--model", "llama-tiny", "--dp", "2", "--cp", "2", "--cp-comm", "allgather", "--zero", "2"],
        ["--model", "llama-tiny", "--dp", "2", "--cp", "2", "--zero", "0"],   # DDP's all-reduce over dp+cp
        ["--model", "llama-tiny", "--cp", "2", "--cp-comm", "a2a", "--tp", "2", "--recompute", "full"],
        ["--model", "llama-moe-tiny", "--tp", "2", "--sp", "--ep", "2"],
        ["--model", "llama-tiny", "--tp", "4", "--sp", "--tp-overlap", "--tp-overlap-comm", "chunked", "--recompute",
         "full"],
        ["--model", "llama-moe-tiny", "--pp", "2", "--ep", "2", "--global-batch", "8", "--micro-batch", "2"],
        ["--model", "llama-moe-tiny", "--dp", "2", "--ep", "2", "--zero", "3", "--moe-two-batch"]],
}


def played(world: int) -> list[int]:
    """The ranks the dry run plays: the first and the last, which hold every axis's first and
    last coordinate (the first and the last pipeline stage, the smaller of uneven shards). A
    play costs seconds of fake-tensor dispatch; the real runs measure every rank."""
    return sorted({0, world - 1})


@pytest.fixture(scope="module")
def dry_runs(request):
    """(world, argv) -> {rank: [state bytes, collectives]} for the `played` ranks of every
    layout below that this session tests (the fast tier: a few), running beside the real runs."""
    tested = {(item.callspec.params["world"], tuple(item.callspec.params["argv"])) for item in request.session.items
              if "dry_runs" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")}
    runs = DryRuns([(w, a + ARGS, played(w), None) for table in (LAYOUTS, DRY_ONLY) for w, group in table.items()
                    for a in group if (w, tuple(a)) in tested], ROOT)
    named = lambda counts: {" ".join(k): v for k, v in counts.items()}  # noqa: E731
    yield lambda world, argv: {rank: (state, named(counts)) for rank, (state, counts) in runs(world, argv).items()}
    runs.close()


@pytest.mark.parametrize("world,argv", [(w, a) for w, layouts in LAYOUTS.items() for a in layouts],
                         ids=lambda v: " ".join(v).replace("--", "") if isinstance(v, list) else str(v))
@pytest.mark.fast_cases(world=2)
def test_each_ranks_state_and_collectives_equal_the_planner_and_the_dry_run(pools, dry_runs, world, argv):
    # bytes of parameters, gradients and optimizer state: measured after a real step, the
    # planner's formula, the dry run's meta build; calls and bytes per (collective, mesh axes)
    # of one step: counted on gloo, the planner's model (comm_model), counted by the dry run
    # on fake tensors
    real = pools.run(world, _measured_and_predicted, argv + ARGS, timeout=300)
    dry = dry_runs(world, argv + ARGS)
    for rank, (measured, predicted, _, _) in enumerate(real):
        assert measured == predicted, f"rank {rank}"
    for rank, (built, simulated) in dry.items():   # the dry run spreads MoE tokens evenly, as the planner
        assert built == real[rank][1] and simulated == real[rank][3][0], f"rank {rank}"
    counted, planned = [r[2][0] for r in real], [r[3][0] for r in real]
    assert all(counted), argv   # every layout here communicates
    assert [r[2][1] for r in real] == [r[3][1] for r in real]   # calls
    if "--ep" in argv:   # the routing decides what each rank's all-to-alls send back, not their total
        total = [sum(r.pop("all_to_all ep") for r in ranks) for ranks in (counted, planned)]
        assert total[0] == total[1], total
    assert counted == planned


@pytest.mark.parametrize("world,argv", [(w, a) for w, layouts in DRY_ONLY.items() for a in layouts],
                         ids=lambda v: " ".join(v).replace("--", "") if isinstance(v, list) else str(v))
@pytest.mark.fast_cases(world=2)
def test_the_planners_collectives_equal_the_dry_runs_count(dry_runs, world, argv):
    from meshtron.config import Config
    from meshtron.train.layout import resolve_layout
    config = Config.from_args(argv + ARGS, models=models.PRESETS)
    spec, cfg, degrees, microbatches, _ = resolve_layout(config, world)
    par, tr = dataclasses.replace(config.parallel, **degrees), config.training
    planned = [{" ".join(k): v for k, v in plan.step_collectives(spec, cfg, par, tr.micro_batch, microbatches,
                                                                  tr.seq_len, rank, device="cpu")[1].items()}
               for rank in range(world)]
    for rank, (_, counted) in dry_runs(world, argv + ARGS).items():   # both spread MoE tokens evenly
        assert counted == planned[rank], f"rank {rank}"


def test_plan_ranks_every_layout_of_64_gpus():
    fit, over = plan.plan("llama-8B", seq_len=8192, global_batch=64, gpus=64, gpus_per_node=8)
    assert fit
    best = fit[0]
    assert best.par.tp <= 8 and best.memory <= plan.GPUS["h200"].memory_bytes
    assert all(a.step_s <= b.step_s for a, b in zip(fit, fit[1:]))
    # on 64 GPUs every layout but DDP (zero 0) shards the fp32 weights and Adam state (12 bytes
    # per parameter, live at every peak; the gradients are not at the loss's) over some axis
    # (dp, cp and ep through FSDP, tp, pp)
    cfg = plan.models.get("llama-8B")[1]
    assert all((p.state >= 12 * cfg.num_params()) == (p.par.zero == 0 and p.par.tp * p.par.pp == 1) for p in fit)


def test_the_command_prints_a_ranked_table(capsys):
    cli.main(["--model", "llama-1B", "--seq-len", "2048", "--global-batch", "32", "--gpus", "4", "--top", "3"])
    out = capsys.readouterr().out
    assert "layouts fit" in out and out.count("meshtron-run --nproc-per-node 4 recipes/train.py --model llama-1B") == 3


def test_a_small_job_shows_its_memory_and_no_nodes(capsys):
    # a tiny model printed 0.0 in every GiB column, and "2 x h200 (8 per node)" for two GPUs
    cli.main(["--model", "tiny", "--seq-len", "64", "--global-batch", "8", "--gpus", "2", "--top", "3"])
    out = capsys.readouterr().out
    header, calibration, columns, *rows = out.splitlines()
    assert "2 x h200: " in header and "per node" not in header, header
    assert calibration.startswith("calibration: "), calibration
    assert columns.split()[4] == "MiB", columns     # "#", "step", "ms", "MFU", then memory
    assert all(float(r.split()[3]) > 0 for r in rows), out


def test_the_table_adds_up_names_ties_once_and_launches_every_node(capsys):
    # issue 36, point 6: GiB = state + bf16 + acts; --zero 1 and 2 rows that predict the same are one row;
    # a multi-node command carries its rendezvous
    cli.main(["--model", "llama-8B", "--seq-len", "8192", "--global-batch", "64", "--gpus", "16", "--top", "8"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 8
    for r in rows:
        assert abs(float(r[3]) - float(r[4]) - float(r[5]) - float(r[6])) <= 0.15, r
    commands = [" ".join(r[7:]).split("   (the same")[0] for r in rows]
    assert len(set(commands)) == 8 and "(the same at --zero 2)" in out, out
    without_zero = [re.sub(r"--zero \d ", "", c) for c, r in zip(commands, rows)]
    keys = [(r[1], r[3], c) for r, c in zip(rows, without_zero)]
    assert len(set(keys)) == len(keys), out    # no two rows predict the same for the same layout but --zero
    assert all("--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 --rdzv-id "
               "$JOB_ID recipes/train.py" in c for c in commands)


def test_gpus_not_whole_nodes_are_refused_and_nodes_times_processes_is_the_world(capsys):
    args = ["--model", "llama-1B", "--seq-len", "2048", "--global-batch", "48", "--gpu", "h100", "--top", "5"]
    with pytest.raises(SystemExit) as e:
        cli.main(args + ["--gpus", "12"])
    assert str(e.value) == ("error: --gpus 12 is not a whole number of 8-GPU nodes: give a multiple of 8, "
                            "or --gpus-per-node 6 (2 nodes of 6)")
    assert capsys.readouterr().out == ""      # refused before any planning
    for gpus, per_node, nodes in ((12, 6, 2), (6, 8, 1), (24, 8, 3)):
        cli.main(args + ["--gpus", str(gpus), "--gpus-per-node", str(per_node)])
        out = capsys.readouterr().out
        launches = re.findall(r"meshtron-run (?:--nnodes (\d+) )?--nproc-per-node (\d+)", out)
        assert launches and all(int(n or 1) * int(p) == gpus and int(n or 1) == nodes for n, p in launches), out
        assert (f"each of the {nodes} nodes" in out) == (nodes > 1), out


def test_the_planners_help_explains_every_flag_the_columns_and_calibrate(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "calibrate" in out and "state" in out and "acts" in out
    assert all(action.help for action in cli.parser()._actions)


# and llama-8B at dp8 x tp8 on 64 ranks: docs/planner.md's command, checked by the docs test (dry_run_64)
@pytest.mark.parametrize("argv,world,ranks", [
    ("--model llama-moe-3B --ep 8 --zero 3 --seq-len 4096", 8, [0, 7]),
], ids=["llama-moe-3B ep8"])
@pytest.mark.slow
def test_the_dry_run_command_prints_the_planners_bytes_for_large_layouts(argv, world, ranks):
    cmd = ["recipes/train.py", *argv.split(), "--dry-run", str(world), "--dry-run-ranks", ",".join(map(str, ranks))]
    out = run_script(cmd, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == ranks and all(r[-1] == "equal" for r in rows), out.stdout
    # and each rank's collectives of one step: FSDP's reduce-scatter, SP's all-gathers or the all-to-alls
    counted = [line for line in out.stdout.splitlines() if line.startswith("  rank ")]
    assert [int(c.split()[1].rstrip(":")) for c in counted] == ranks, out.stdout
    assert all("reduce_scatter over" in c and ("all_gather over tp" in c or "all_to_all over ep" in c)
               for c in counted), out.stdout
    assert all(c.endswith("planner equal") for c in counted), out.stdout   # at 64 ranks too


def test_the_dry_run_prints_where_sys_stdout_points_when_it_runs():
    # not where it pointed when meshtron was imported: a script forked from a process that
    # imported it under another stdout (a test runner's capture) printed its table there
    import contextlib
    import io

    from meshtron.config import Config
    from meshtron.planner.dry_run import dry_run
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        dry_run(Config.from_args(["--model", "tiny", "--tp", "2"]), 2, [1])
    assert out.getvalue().startswith("dry run: tiny") and "planner equal" in out.getvalue(), out.getvalue()


def test_the_dry_run_refuses_a_bad_layout_before_building_anything():
    out = run_script(["recipes/train.py", "--model", "llama-8B", "--tp", "3", "--dry-run", "64"], timeout=120, cwd=ROOT)
    assert out.returncode == 1 and "does not divide the world size 64" in out.stderr and "rank" not in out.stdout


def test_the_alpha_beta_fit_recovers_a_known_link():
    from meshtron.planner.calibrate import fit_alpha_beta
    n, alpha, bw = 4, 20e-6, 300e9
    samples = [(kind, b, alpha * (n - 1) + f * b / bw) for b in (2 ** 16, 2 ** 20, 2 ** 24, 2 ** 28)
               for kind, f in (("all_gather", (n - 1) / n), ("all_reduce", 2 * (n - 1) / n))]
    got_alpha, got_bw = fit_alpha_beta(samples, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


def _link(rank, world):
    from meshtron.planner.calibrate import fit_alpha_beta, link_samples
    samples = link_samples(torch.device("cpu"), [2 ** 14, 2 ** 20, 2 ** 23], repeats=3)
    return samples, fit_alpha_beta(samples, world)


def test_calibrate_times_the_links_collectives_the_same_on_every_rank(pools):
    (samples, fit), (samples1, fit1) = pools.run(2, _link)
    assert samples == samples1 and fit == fit1 and len(samples) == 6
    assert fit[0] >= 0 and fit[1] > 0


@pytest.mark.slow
def test_calibrate_writes_a_file_the_planner_reads(tmp_path):
    out = tmp_path / "cal.json"
    run = run_script(["-m", "meshtron.plan", "calibrate", "--model", "tiny", "--tokens", "128", "--seq-len", "64",
                      "--out", str(out), "--quick"], timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    hw = plan.hardware(str(out))
    data = json.loads(out.read_text())
    assert 0 < hw.matmul_efficiency and 0 < hw.attention_efficiency and hw.hbm_bandwidth > 0
    # no link on one CPU
    assert data["measured"] == ["matmul_efficiency", "matmul_curve", "attention_efficiency", "attention_curve",
                                "hbm_bandwidth", "matmul_dtype_ratio", "attention_fp32_ratio",
                                "host_microbatch_s", "host_layer_s", "host_layer_full_s", "host_layer_selective_s",
                                "host_layers"]
    # what it measured is what the planner reads: fp32's rate and each family's host time per layer
    assert hw.dtype_ratio("fp32") == data["matmul_dtype_ratio"][0][1] > 0
    assert {(f, r) for f, r, _ in hw.host_layers} >= {("llama", "none"), ("gpt", "none"), ("moe", "none")}
    assert [t for t, _ in hw.matmul_curve] == [256, 1024] and hw.matmul_at(512) > 0
    assert [(hd, s) for hd, s, _ in hw.attention_curve] == [(8, 64), (8, 128), (16, 64), (16, 128)]
    assert all(e > 0 for *_, e in hw.attention_curve)
    fit, _ = plan.plan("tiny", seq_len=64, global_batch=8, gpus=2, gpu=str(out))
    assert fit


def test_the_matmul_curve_interpolates_in_log_tokens_and_holds_flat_beyond_its_ends():
    hw = dataclasses.replace(plan.GPUS["h200"], matmul_curve=((1024, 0.5), (4096, 0.7)))
    assert hw.matmul_at(1024) == 0.5 and hw.matmul_at(4096) == 0.7
    assert hw.matmul_at(2048) == pytest.approx(0.6)     # halfway in log2
    assert hw.matmul_at(64) == 0.5 and hw.matmul_at(1 << 20) == 0.7
    assert dataclasses.replace(hw, matmul_curve=()).matmul_at(2048) == hw.matmul_efficiency


def test_attention_efficiency_follows_the_nearest_head_dims_curve_over_the_sequence():
    hw = dataclasses.replace(plan.GPUS["h200"], attention_curve=((64, 1024, 0.2), (64, 4096, 0.4),
                                                                 (128, 1024, 0.3), (128, 4096, 0.5)))
    assert hw.attention_at(64, 2048) == pytest.approx(0.3) and hw.attention_at(128, 2048) == pytest.approx(0.4)
    assert hw.attention_at(80, 1024) == 0.2 and hw.attention_at(100, 1024) == 0.3   # nearest in log2
    assert hw.attention_at(128, 1 << 20) == 0.5 and hw.attention_at(64, 16) == 0.2   # flat beyond the ends
    assert dataclasses.replace(hw, attention_curve=()).attention_at(64, 2048) == hw.attention_efficiency


def test_eager_host_time_follows_the_recompute_mode_and_compiling_removes_it():
    hw = dataclasses.replace(plan.GPUS["h200"], host_microbatch_s=0.0, host_layer_s=1e-3, host_layer_full_s=2e-3,
                             host_layer_selective_s=1.0, host_layers=())
    assert [hw.host_layer(m) for m in ("none", "full", "selective")] == [1e-3, 2e-3, 1.0]
    # a family's own measurement wins over the plain one
    assert dataclasses.replace(hw, host_layers=(("gpt", "selective", 0.5),)).host_layer("selective", "gpt") == 0.5
    assert dataclasses.replace(hw, host_layer_full_s=0.0).host_layer("full") == 1e-3   # not measured: the plain one
    spec, cfg = models.get("tiny")

    def step_s(recompute, compile=False):
        par = ParallelConfig(dp=1, recompute=recompute, compile=compile)
        return plan.predict(spec, cfg, par, micro_batch=1, microbatches=2, seq_len=64, hw=hw, gpus_per_node=8).step_s
    # a tiny model's GPU time is far below a second: the selective step waits 2 micro-batches x its layers on the host
    assert step_s("selective") >= 2 * cfg.n_layers * 1.0
    assert step_s("selective", compile=True) < 1.0 and step_s("none") < 1.0


def _saved_per_layer(rank, world, name, sp):
    """Bytes autograd keeps for backward per layer and token (fp32), counted with
    saved-tensor hooks on the 1- and the 2-layer model at tp=world."""
    from harness import mesh
    spec, preset = models.get(name)
    m = mesh(tp=world)
    totals = []
    for layers in (1, 2):
        cfg = dataclasses.replace(preset, n_layers=layers)
        model = spec.model_cls(cfg, seed=0)
        spec.parallelize(model, m, ParallelConfig(tp=world, sp=sp))
        seen = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                for p in model.parameters()}
        total = [0]

        def pack(t, seen=seen, total=total):
            local = t.to_local() if isinstance(t, DTensor) else t
            try:
                storage = local.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except RuntimeError:    # a tensor DTensor's decomposition made without a storage of its own
                ptr, nbytes = id(local), local.numel() * local.element_size()
            if ptr not in seen:
                seen.add(ptr)
                total[0] += nbytes
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, cfg.vocab_size, (2, 32)))
        totals.append(total[0])
    return (totals[1] - totals[0]) / 4 / 64, plan._layer_elements(cfg, world, sp)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_activation_elements_per_layer_equal_what_autograd_keeps(pools, sp):
    # under SP the column-parallel matmuls keep their gathered input: the planner counts it whole.
    # The GPT's CPU ops save what its GPU ops do; the Llama's RMSNorm, RoPE and SwiGLU save
    # more on the CPU than the fused kernels and compiled blocks the planner was fitted to
    measured, predicted = pools.run(2, _saved_per_layer, "tiny", sp)[0]
    assert abs(measured / predicted - 1) < 0.02, (measured, predicted)


def test_calibrate_times_a_layer_in_the_dtypes_the_trainers_step_runs_it(monkeypatch):
    """calibrate's host time is the trainer's layer as one bf16 process runs it: the experts'
    GEMMs see the same dtypes (an fp32 residual stream sent them down the per-expert fp32 loop,
    a third of the measured H200 host time of a MoE layer)."""
    import io
    from contextlib import redirect_stdout

    import meshtron.models.common.experts as experts
    from meshtron import models
    from meshtron.cli.train import main
    from meshtron.planner.calibrate import host_seconds
    seen, grouped_mm = [], experts.grouped_mm
    monkeypatch.setattr(experts, "grouped_mm", lambda x, w, c: seen.append((x.dtype, w.dtype)) or grouped_mm(x, w, c))
    with redirect_stdout(io.StringIO()):
        main(["--model", "llama-moe-tiny", "--steps", "1", "--dtype", "bf16", "--seq-len", "32", "--global-batch", "4"])
    trainer, seen[:] = set(seen), []
    spec, cfg = models.get("llama-moe-tiny")
    host_seconds(spec, cfg, torch.device("cpu"), repeats=1, tokens=16, dtype=torch.bfloat16)
    assert set(seen) == trainer == {(torch.bfloat16, torch.float32)}
