"""One trainer for every registered model and every layout of the mesh.

    trainer = Trainer(Config.from_args(models=meshtron.models.PRESETS))
    losses = trainer.train()

Set-up, in this order: every check that needs no process group (config, the
checkpoint directory's lock, model layout, data, checkpoint files), agreed across ranks; the mesh; the model built
on the meta device, cut into pipeline stages, parallelized by its spec (TP,
recompute, compile, FSDP), materialized and initialized by parameter name (the
same values under any layout); optimizer, schedule, data loader; the checkpoint
manager, and the checkpoint or safetensors to start from. Then the loop: `step`
runs one forward/backward over the local batch (micro-batches in turn, or the
pipeline schedule), clips by the global norm and steps the optimizer; logging,
metrics and checkpoints around it.

Loss and gradients: meshtron/train/step.py. The command line: meshtron/cli/train.py.
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtron.command_line import WARMUP_STEPS
from meshtron.config import Config, ConfigError
from meshtron.data import BatchLoader, open_data
from meshtron.data.sources import is_text
from meshtron.data.tokenizer import export_tokenizer
from meshtron.distributed import cuda_graphs, local_tensor_parallel
from meshtron.distributed.agree import agree
from meshtron.distributed.context_parallel import shard_sequence
from meshtron.distributed.data_parallel import autocast_dtype, reshard
from meshtron.distributed.float8 import precompute_scales
from meshtron.distributed.mesh import batch_slice, default_device_type, degree, init_mesh, world_size
from meshtron.distributed.pipeline_parallel import Pipeline
from meshtron.distributed.reduce import sum_over
from meshtron.distributed.tied import materialize
from meshtron.models.common.documents import document_inputs, kept_pairs
from meshtron.models.common.moe import RoutingStats
from meshtron.train import hf
from meshtron.train.checkpoint_manager import CheckpointManager, find_resume, hold_directory
from meshtron.train.layout import build_model, pipeline_io, resolve_layout
from meshtron.train.lifetime import DirectoryLock
from meshtron.train.loss import IGNORE_INDEX, forward_kwargs
from meshtron.train.metrics import RunLog, Throughput, peak_memory_gib
from meshtron.train.optim import build_optimizer, warmup_cosine
from meshtron.train.progress import Progress
from meshtron.train.step import _value, gradients, layout_loss, micro_batch_loss, moe_end_step
from meshtron.train.stragglers import Stragglers
from meshtron.train.watchdog import Watchdog


class Trainer:
    """Everything a run needs, built once from a Config: `parts` (the model, or this
    rank's pipeline stages), `optimizer`, `scheduler`, `loader`, `checkpoints` (what the run
    resumes and its saves), and `step`/`train`; once trained, `step_s`: each training step's
    own seconds (evaluation and saves left out). Rank 0 holds --checkpoint-dir's lock from
    set-up until `close` (which `train` calls at its end), after any background save
    (--checkpoint-async) has finished; a set-up that fails releases it."""

    def __init__(self, config: Config, *, verbose: bool = True):
        self.config = config.on_device(default_device_type())   # --dtype left out: bf16 on GPUs, fp32 on the CPU
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.lock: DirectoryLock | None = None
        self.run_log: RunLog | None = None
        self.checkpoints: CheckpointManager | None = None
        self.progress = Progress()   # where the loop is, for the watchdog and the stragglers (progress.py)
        self.watchdog: Watchdog | None = None
        try:
            self._set_up(verbose)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Wait for a background save and stop its writer process, release the checkpoint
        directory and close the run's logs; safe to repeat."""
        if self.watchdog is not None:
            self.watchdog.stop()
        try:
            if self.checkpoints is not None:   # once it returns no thread of the run touches the directory
                self.checkpoints.close()
        finally:   # whatever the save did (an interrupt too), the logs close and the lock goes
            if self.run_log is not None:
                self.run_log.close()
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    # ---- set-up ----------------------------------------------------------------------

    def _set_up(self, verbose: bool) -> None:
        """The run's set-up, in order; each line one step of it."""
        c = self.config
        with agree():   # nothing has communicated yet: every problem stops every rank here
            self.spec, self.model_config, degrees, self.microbatches, self.global_batch = resolve_layout(
                c, world_size())   # the config, then the layout against the model
            cuda_graphs.check_device(c.parallel.cuda_graphs, default_device_type())
            local_tensor_parallel.check_comm(c.parallel.tp_overlap_comm, default_device_type())
            self.run_log = RunLog(self.rank, c.training.metrics_file, c.training.tensorboard, verbose)
            data = self._open_data()
            # what to resume, read before the directory is locked or cleared: a directory of
            # another model's checkpoints is refused with its files untouched
            resume = find_resume(c, self.model_config, self._model_name(), self.log)
            self.lock = hold_directory(c.checkpoint.checkpoint_dir, self.log) if self.rank == 0 else None
        self.mesh = init_mesh(**degrees)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda"
                       else torch.device("cpu"))
        torch.manual_seed(c.training.seed)
        with agree():
            self.parts, self.pipeline = self._build_model()
            self.optimizer, self.scheduler = self._build_optimizer()
            self.loader, self.eval_loader = self._build_loaders(*data)
            self._import_weights()
        self.loss_fn = layout_loss(self.mesh, c.parallel, self.device, self.parts)
        # with --checkpoint-async, its own process group and writer processes: made here, on every rank
        self.checkpoints = CheckpointManager(
            c, resume, self.parts, self.optimizer, self.scheduler, self.loader, names=self._param_names(),
            record=dict(config=self.model_config, model=self.spec.name, preset=self._model_name(),
                        tokenizer=self._tokenizer()), progress=self.progress, log=self.log)
        self.moe_stats = None   # the last step's routing statistics (mixture-of-experts models)
        if self.pipeline is not None:
            self.pipeline.build_schedule(self.loss_fn, pipeline_io(self.model_config, c, self.mesh),
                                         forward_kwargs(self.loss_fn))
        self.start = self.checkpoints.resume()
        if c.parallel.fp8 == "tensorwise":   # the first step's fp8 weight scales, from the weights it starts from
            precompute_scales(self.parts)

    def _precision(self) -> str:
        """The run's precision, for its start-up line: a GPU run without --dtype computes in bf16."""
        p = self.config.parallel
        fp8 = f" with FP8 matmuls ({p.fp8}{', emulated on the CPU' if self.device.type == 'cpu' else ''})" \
            if p.fp8 != "none" else ""
        return f"{p.dtype} compute{fp8}, fp32 master weights, {p.reduce_dtype} gradient reduction"

    def _open_data(self) -> tuple:
        """The training tokens and the held-out ones (None without --eval-data)."""
        d, vocab = self.config.data, self.model_config.vocab_size
        return (open_data(d.data, vocab, d.tokenizer, documents=self._documents()),
                open_data(d.eval_data, vocab, d.tokenizer, documents=self._documents()) if d.eval_data else None)

    def _build_optimizer(self) -> tuple:
        tr = self.config.training
        optimizer = build_optimizer(self.parts, tr.lr, weight_decay=tr.weight_decay)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(tr.warmup, tr.steps,
                                                                                        tr.min_lr_ratio))

    def _build_loaders(self, tokens, eval_tokens) -> tuple:
        """This rank's slice of every global batch, for training and evaluation."""
        tr, index, count = self.config.training, *batch_slice(self.mesh)
        note = ""
        if tr.global_batch is None:   # the default moves with the layout: --tp 2 on 2 ranks halves it
            per = f" x {self.microbatches} micro-batches" if self.microbatches > 1 else ""
            note = (f" (the default: --micro-batch {tr.micro_batch} x {count} data-parallel rank"
                    f"{'s' if count > 1 else ''} (dp x ep){per}, so the other axes' degrees change it)")
        loader = BatchLoader(tokens, tr.seq_len, self.global_batch, index, count, tr.micro_batch, seed=tr.seed,
                             shuffle=self.config.data.shuffle, batch_note=note)
        return loader, None if eval_tokens is None else BatchLoader(
            eval_tokens, tr.seq_len, self.global_batch, index, count, tr.micro_batch, seed=tr.seed)

    def _import_weights(self) -> None:
        """--init-from-hf / --import-safetensors: weights from outside, over the initial ones."""
        ck = self.config.checkpoint
        weights = ck.init_from_hf or ck.import_safetensors
        if weights:
            hf.import_safetensors(self.parts, weights, self.model_config, self.spec.hf)

    def _build_model(self) -> tuple[list[nn.Module], Pipeline | None]:
        parts, pipeline = build_model(self.spec, self.model_config, self.mesh, self.config.parallel,
                                      self.microbatches)
        for m in parts:
            materialize(m, self.device)
            m.init_weights(self.config.training.seed)   # drawn by parameter name: the same under any layout
        return parts, pipeline

    def _model_name(self) -> str:
        """What the user called the model: its preset, or the Hugging Face checkpoint it came from."""
        ck = self.config.checkpoint
        return f"{self.spec.name} from {ck.init_from_hf}" if ck.init_from_hf else self.config.model.model

    def _tokenizer(self) -> str | None:
        """The tokenizer the training text was read with, for generation to use: None
        where the data were token ids already (a token file, a Megatron dataset)."""
        d = self.config.data
        return (os.path.abspath(d.tokenizer) if d.tokenizer else "bytes") if is_text(d.data) else None

    def _documents(self) -> bool:
        """Whether a step reads the samples' document boundaries (--document-mask and its kin)."""
        d = self.config.data
        return d.document_mask or d.document_positions or d.eod_mask_loss

    def next_batch(self, loader=None) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
        """This rank's next (inputs, targets, the model's per-token keyword inputs) of `loader`
        (the training one by default): evaluation reads documents as training does."""
        loader = self.loader if loader is None else loader
        if not self._documents():
            return *loader.next(), None
        d = self.config.data
        x, y, documents = loader.next_batch()
        y, inputs = document_inputs(documents, y, mask=d.document_mask, positions=d.document_positions,
                                    eod_mask_loss=d.eod_mask_loss, ignore_index=IGNORE_INDEX)
        return x, y, inputs

    def _param_names(self) -> dict[int, str] | None:
        return self.pipeline.param_names() if self.pipeline is not None else None

    # ---- the step ------------------------------------------------------------------

    def step(self, x: torch.Tensor, y: torch.Tensor, inputs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's part of a global batch; (loss, grad norm)
        as device tensors (reading them syncs the GPU). `inputs`: next_batch's."""
        if self.config.parallel.cuda_graphs:
            cuda_graphs.step_begin()
        loss, norm = gradients(self.parts, x, y, self.mesh, self.pipeline, self.config, self.microbatches,
                               self.loss_fn, inputs)
        self.progress.at("optimizer")
        self.optimizer.step()
        if self.config.parallel.fp8 == "tensorwise":   # the next all-gathers' fp8 scales, in one all-reduce
            precompute_scales(self.parts)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if getattr(self.model_config, "moe", None) is not None:
            self.moe_stats = moe_end_step(self.parts, self.mesh)
        return loss, norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-mean loss over the first --eval-steps global batches of --eval-data
        (the same batches every time), forward only, under the training layout."""
        n = self.config.data.eval_steps
        self.eval_loader.step = 0
        total = count = torch.zeros((), device=self.device)
        par = self.config.parallel
        amp = autocast_dtype(self.mesh, par.dtype, par.mixed_precision)   # as the training step's forward
        if par.cuda_graphs:
            cuda_graphs.step_begin()
        for m in self.parts:
            m.eval()
        for _ in range(n):
            x, y, inputs = self.next_batch(self.eval_loader)
            x, y = x.to(self.device), y.to(self.device)
            inputs = {k: t.to(self.device) for k, t in (inputs or {}).items()}
            if degree(self.mesh, "cp") > 1:
                x, y = shard_sequence(x, self.mesh), shard_sequence(y, self.mesh)
                inputs = {k: shard_sequence(t, self.mesh) for k, t in inputs.items()}
            count = count + sum_over((y != IGNORE_INDEX).sum().float(), self.mesh, "loss")
            if self.pipeline is not None:
                s = sum_over(self.pipeline.evaluate(x, y, inputs), self.mesh, "pp")
            else:
                split = [dict(zip(inputs, ts)) for ts in zip(*(t.chunk(self.microbatches) for t in inputs.values()))] \
                    if inputs else [None] * self.microbatches
                s = sum(_value(micro_batch_loss(self.parts[0], xs, ys, self.loss_fn, amp, split[i])) for i, (xs, ys)
                        in enumerate(zip(x.chunk(self.microbatches), y.chunk(self.microbatches))))
            total = total + sum_over(s, self.mesh, "loss")
        reshard(self.parts)
        for m in self.parts:
            m.train()
        return float(total / count.clamp_min(1))

    # ---- the loop --------------------------------------------------------------------

    def log(self, line: str) -> None:
        self.run_log.print(line)

    def train(self, exit_after: int | None = None, on_step=None, on_end=None) -> list[float]:
        """Train to --steps (or `exit_after` steps of this run); returns the losses.
        `on_step(step)`, if given, runs before each step (the command line's test hooks),
        `on_end()` once the loop is over, before the closing line (the command line's
        measured-vs-predicted line)."""
        c, tr, ck = self.config, self.config.training, self.config.checkpoint
        if exit_after is not None and exit_after < 1:
            raise ConfigError(f"exit_after must be at least 1, not {exit_after}")
        mc, mesh = self.model_config, self.mesh
        flops = mc.flops_per_token(tr.seq_len)
        meter = Throughput(flops, dist.get_world_size(), self.device, flops - mc.flops_per_token(0))
        masked = (" | document mask on: attention FLOPs count the query-key pairs it keeps"
                  if c.data.document_mask else "")
        self.log(f"meshtron | {self._model_name()} ({mc.num_params() / 1e6:.1f}M params) | mesh "
                 f"{dict(zip(mesh.mesh_dim_names, mesh.shape))} | {self._precision()} | "
                 f"global batch {self.global_batch} x {tr.seq_len} "
                 f"tokens, {self.microbatches} micro-batch{'es' if self.microbatches != 1 else ''} of "
                 f"{tr.micro_batch} | {self.loader.n_samples} samples"
                 + masked)
        self.stragglers = Stragglers(tr.straggler_threshold, self.device)
        self.watchdog = Watchdog(self.progress, hang_timeout=tr.hang_timeout, pg_timeout=tr.pg_timeout,
                                 checkpoint_dir=ck.checkpoint_dir, metrics_file=tr.metrics_file,
                                 resume_auto=ck.resume == "auto",
                                 # a background save's waits have the saver's own bound, --pg-timeout
                                 unarmed=("checkpoint",) if ck.checkpoint_async else ())
        self.watchdog.start()
        losses, t_start = [], time.perf_counter()
        self.step_s = []   # each step's own seconds, evaluation and saves left out
        last = min(tr.steps, self.start + exit_after) if exit_after else tr.steps
        for step in range(self.start + 1, last + 1):
            self.progress.at("data loading", step)
            if on_step is not None:
                on_step(step)
            t_step = time.perf_counter()
            x, y, inputs = self.next_batch()
            self.progress.at("forward/backward")
            loss, norm = self.step(x, y, inputs)
            # this rank's samples stand for the global batch's: no collective for a log figure
            meter.add(self.global_batch * tr.seq_len,
                      kept_pairs(inputs["documents"]) if inputs and "documents" in inputs else 1.0)
            losses.append(loss)   # a device tensor: reading it every step would sync the GPU
            if step == self.start + 1:   # the state is whole after a step
                self.checkpoints.prepare()
            if step % tr.log_interval == 0 or step == tr.steps or step == self.start + 1:
                self.progress.at("logging")
                self.stragglers.interval(self.progress, step, self.log)
                self._report(step, float(losses[-1]), float(norm), meter.report(), time.perf_counter() - t_start)
            evaluating = self.eval_loader is not None and (step % c.data.eval_interval == 0 or step == tr.steps)
            if (evaluating or self.checkpoints.due(step) or step == last or step - self.start <= WARMUP_STEPS) and \
                    self.device.type == "cuda":   # the step's queued kernels are its time, not the next thing's
                torch.cuda.synchronize(self.device)
            self.step_s.append(time.perf_counter() - t_step)
            if evaluating:
                self.progress.at("evaluation")
                eval_loss = self.evaluate()
                self.run_log.record(step, {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 80))},
                                    f"eval {step:>6}/{tr.steps} | loss {eval_loss:.4f} | ppl "
                                    f"{math.exp(min(eval_loss, 80)):.2f}")
            self.checkpoints.maybe_save(step)
        self.progress.at("finishing")   # not watched: the export, the last save's wait
        if ck.export_hf:   # no transformers class has meshtron's MoE block: those keep meshtron's names
            hf.export_safetensors(self.parts, ck.export_hf, mc, None if getattr(mc, "moe", None) else self.spec.hf)
            # a token file's --tokenizer is the one that made its ids; without one its tokenizer is unknown
            tokenizer = c.data.tokenizer or self._tokenizer()
            with agree():
                if tokenizer is not None and dist.get_rank() == 0:
                    export_tokenizer(tokenizer, ck.export_hf)
            self.log(f"exported the weights to {ck.export_hf} (Hugging Face safetensors) " + (
                f"with the tokenizer ({tokenizer})" if tokenizer else
                "without a tokenizer: the data were token ids (--tokenizer names the one that made them)"))
        if self.pipeline is not None:   # memory differs by stage: the first holds the most micro-batches
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, (self.pipeline.stage_ids, peak_memory_gib(self.device)))
            for r, (ids, mem) in enumerate(per_rank):
                host = " (host RSS)" if self.device.type == "cpu" else ""
                self.log(f"rank {r} stages {ids}: peak mem {mem:.2f} GiB{host}")
        if on_end is not None:
            on_end()
        waited = self.checkpoints.finish()   # its line, if any, then the closing one, which says it waited
        self._closing_line(losses, last, time.perf_counter() - t_start, waited)
        self.close()
        return [float(x) for x in losses]

    def _closing_line(self, losses: list, last: int, seconds: float, waited: str = "") -> None:
        """What the run did and what it left behind, in one line; `waited`: CheckpointManager.finish's."""
        c, done = self.config, last - self.start
        final = f"final loss {float(losses[-1]):.4f}" if losses else "no step run"
        final += self.stragglers.summary()
        wrote = [f"checkpoints in {c.checkpoint.checkpoint_dir}{waited}" if c.checkpoint.checkpoint_dir else
                 "no checkpoint (--checkpoint-dir)"]
        if c.training.metrics_file:
            wrote.append(f"metrics in {c.training.metrics_file}")
        if c.checkpoint.export_hf:
            wrote.append(f"weights exported to {c.checkpoint.export_hf}")
        if done <= 0:   # resumed at or past --steps
            self.log(f"done: no step to run: resumed at step {self.start} and --steps is {c.training.steps}; "
                     + ", ".join(wrote))
            return
        self.log(f"done: {done} steps ({self.start + 1}-{last} of {c.training.steps}), "
                 f"{done * self.global_batch * c.training.seq_len:,} tokens in {seconds:.0f} s, {final}; "
                 + ", ".join(wrote))

    def _report(self, step: int, loss: float, norm: float, m: dict, elapsed: float) -> None:
        tr = self.config.training
        lr = self.scheduler.get_last_lr()[0]
        mem = peak_memory_gib(self.device)
        eta = elapsed / (step - self.start) * (tr.steps - step)
        # a CPU run has ranks, not GPUs, and does GFLOP/s
        per, flops = ("gpu", f"{m['tflops_per_gpu']:.2f} TFLOP/s") if self.device.type == "cuda" else \
            ("rank", f"{m['tflops_per_gpu'] * 1e3:.2f} GFLOP/s")
        line = (f"step {step:>6}/{tr.steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {norm:.3f} | "
                f"{m['tokens_per_s']:,.0f} tok/s ({m['tokens_per_s_per_gpu']:,.0f}/{per}) | {flops}/{per}")
        if "mfu" in m:
            line += f" | MFU {100 * m['mfu']:.1f}%"
        moe = {}
        if self.moe_stats is not None:
            st = RoutingStats(*torch.stack(self.moe_stats).tolist())   # one read of the device
            moe = {"aux_loss": st.aux_loss, "expert_load_max_over_mean": st.load,
                   "router_load_max_over_mean": st.router_load}
            if self.model_config.moe.balanced:
                note = " (balanced routing)"
            elif self.model_config.moe.batch_balance:
                note = f" (router's own {st.router_load:.2f})"
            else:
                note = ""
            line += f" | aux {st.aux_loss:.4f} | load max/mean {st.load:.2f}{note}"
            if self.model_config.moe.capacity > 0:
                moe["dropped_fraction"] = st.dropped / max(st.routed, 1.0)
                line += f" | dropped {100 * moe['dropped_fraction']:.1f}%"
        if mem is not None:
            line += f" | peak mem {mem:.2f} GiB" + (" (host RSS)" if self.device.type == "cpu" else "")
        self.run_log.record(step, {"loss": loss, "lr": lr, "grad_norm": norm, **moe, **m, "peak_mem_gib": mem},
                            line + f" | eta {eta:,.0f}s")
