"""The loader: global batches of samples in a source's order, each data-parallel
rank reading its contiguous slice. Its whole state is the number of global
batches served, so a checkpoint stores it and a run resumes exactly, under any
data-parallel degree."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshtron.data.sources import Tokens


@dataclass
class BatchLoader:
    """Global batch `step` takes the next `global_batch` samples of the epoch's
    order, as consecutive global micro-batches of micro_batch x n samples each;
    data-parallel rank r of n takes its micro_batch of each (which the trainer runs
    as its micro-batches, in order). So the samples computed together, the i-th
    micro-batch of every rank, are the same under any layout with the same global
    micro-batch: one process at --micro-batch 2 and two ranks at --micro-batch 1
    both take samples (0, 1), then (2, 3). An MoE's batch balancing evens the
    routing over exactly that group (models/common/moe.py), so its routing does not
    depend on how ranks and micro-batches are cut. `data`: a source
    (sources.Tokens or Blend) or an array of token ids."""

    data: object
    seq_len: int
    global_batch: int
    dp_rank: int = 0
    dp_size: int = 1
    micro_batch: int | None = None
    seed: int = 0
    step: int = 0
    shuffle: bool = True
    batch_note: str = ""   # how the run came to its global batch, for the resume error ("(the default, ...)")

    def __post_init__(self):
        if not hasattr(self.data, "order"):     # an array of token ids
            self.data = Tokens(self.data)
        if self.global_batch % self.dp_size:
            raise ValueError(f"global batch {self.global_batch} is not divisible by the data-parallel size "
                             f"{self.dp_size}")
        self.local_batch = self.global_batch // self.dp_size
        self.micro_batch = self.micro_batch or self.local_batch
        if self.local_batch % self.micro_batch:
            raise ValueError(f"local batch {self.local_batch} (= global {self.global_batch} / dp {self.dp_size}) "
                             f"is not divisible by the micro-batch {self.micro_batch}")
        self.n_samples = self.data.num_samples(self.seq_len)
        if self.n_samples < self.global_batch:
            raise ValueError(f"the data makes {self.n_samples} samples of length {self.seq_len}, fewer than one "
                             f"global batch of {self.global_batch}")
        self.batches_per_epoch = self.n_samples // self.global_batch
        self._epoch, self._order = -1, None

    def _samples(self, step: int):
        epoch, i = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.data.order(self.seq_len, self.seed, epoch, self.shuffle)
        ids = self._order[i * self.global_batch:(i + 1) * self.global_batch]
        m, group = self.micro_batch, self.micro_batch * self.dp_size   # a global micro-batch
        mine = [g + self.dp_rank * m + j for g in range(0, self.global_batch, group) for j in range(m)]
        return ids[mine]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the next global batch: inputs and targets, (local batch, T)."""
        return self.next_batch(documents=False)[:2]

    def next_batch(self, documents: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`next`, and each sample's document index of every one of its T + 1 tokens
        (the inputs' and the last target's; the sample's first document is 0), from
        the source's document starts (open_data(..., documents=True))."""
        ids = self._samples(self.step)
        self.step += 1
        xy = torch.from_numpy(np.stack([self.data.sample(i, self.seq_len) for i in ids]))
        docs = torch.from_numpy(np.stack([self.data.documents(i, self.seq_len) for i in ids])) if documents else None
        return xy[:, :-1], xy[:, 1:], docs

    def state_dict(self) -> dict:
        return {"step": self.step, "global_batch": self.global_batch, "seq_len": self.seq_len, "seed": self.seed}

    def load_state_dict(self, sd: dict, rebatch_by_tokens: bool = False) -> None:
        """Resume exactly: the position is in global batches, so any data-parallel
        degree continues with the same samples. A different global batch or sequence
        length cannot continue the same sample order; with rebatch_by_tokens the run
        goes on at the same token count, sample order recomputed for the new batch."""
        if sd["seed"] != self.seed:
            raise ValueError(f"data loader state has seed={sd['seed']}, this run uses {self.seed}")
        if (sd["global_batch"], sd["seq_len"]) != (self.global_batch, self.seq_len):
            if not rebatch_by_tokens:
                same = [f"--global-batch {sd['global_batch']}"] * (sd["global_batch"] != self.global_batch) + \
                       [f"--seq-len {sd['seq_len']}"] * (sd["seq_len"] != self.seq_len)
                raise ValueError(
                    f"the checkpoint's data position is {sd['step']} batches of {sd['global_batch']} x {sd['seq_len']} "
                    f"tokens; this run uses {self.global_batch} x {self.seq_len}{self.batch_note}, which cannot "
                    f"continue the same sample order: pass {' '.join(same)} to continue it, or --data-rebatch to go "
                    "on at the same token count")
            self.step = sd["step"] * sd["global_batch"] * sd["seq_len"] // (self.global_batch * self.seq_len)
            return
        self.step = sd["step"]
