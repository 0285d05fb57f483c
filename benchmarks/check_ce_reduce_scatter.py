"""--tp-overlap-comm copy-engine's reduce-scatter (`ce_reduce_scatter`) against NCCL's, on
GPUs: the CPU tests check its arithmetic on simulated copies
(tests/distributed/test_local_tensor_parallel.py); this checks the copies themselves.

    torchrun --nproc-per-node 2 benchmarks/check_ce_reduce_scatter.py
    torchrun --nproc-per-node 4 benchmarks/check_ce_reduce_scatter.py

Per case (shape, dtype, values) every rank reduce-scatters its own (B, T, d) over the
sequence both ways and compares: integer values, whose sums are exact in any order, must
match NCCL's to the bit; random normal ones to the rounding of sums taken in another
order. Calls follow one another with no host sync between them, each waited for as
--tp-overlap waits (the caller's stream on the returned one), so a reuse of the workspace
before every peer read it shows too. Rank 0 prints one line per case and the verdict;
the exit status is 1 on any mismatch. On the two-GPU machine keep NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 set.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from meshtron.distributed.local_tensor_parallel import ce_reduce_scatter, enable_copy_engine  # noqa: E402

CALLS = 4   # back to back per case, each with its own input


def nccl_reduce_scatter(x: torch.Tensor, tp: int) -> torch.Tensor:
    """The sum of every rank's x[:, r-th T/tp] on rank r, as _column_backward's NCCL path takes it."""
    chunks = x.unflatten(1, (tp, -1)).transpose(0, 1).flatten(0, 1).contiguous()
    out = x.new_empty(x.shape[0], x.shape[1] // tp, *x.shape[2:])
    dist.reduce_scatter_tensor(out, chunks)
    return out


def case(shape: tuple[int, ...], dtype: torch.dtype, integer: bool, seed: int, tp: int, dev, group: str):
    """(the largest difference from NCCL over CALLS calls, relative to NCCL's largest value;
    the tolerance: none for integers, else each side's tp - 1 roundings of the sum)."""
    g = torch.Generator(dev).manual_seed(seed)
    if integer:   # |sum| <= tp * 32: exact in bf16's 8 significant bits at tp <= 4, in fp32 at any
        xs = [torch.randint(-32, 33, shape, generator=g, device=dev).to(dtype) for _ in range(CALLS)]
    else:
        xs = [torch.randn(shape, generator=g, device=dev, dtype=dtype) for _ in range(CALLS)]
    outs, main = [], torch.cuda.current_stream(dev)
    for x in xs:
        out, stream = ce_reduce_scatter(x, group)
        main.wait_stream(stream)
        out.record_stream(main)
        outs.append(out)
    worst = 0.0
    for x, out in zip(xs, outs):
        ref = nccl_reduce_scatter(x, tp).float()
        worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
    return worst, 0.0 if integer else 2 * (tp - 1) * torch.finfo(dtype).eps


def main() -> None:
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    group = dist.group.WORLD.group_name
    enable_copy_engine(group, "cuda")
    failed = 0
    for shape in ((1, 8 * tp, 16), (3, 64 * tp, 96), (16, 2048, 2048)):
        for dtype in (torch.float32, torch.bfloat16):
            for integer in (True, False):
                worst, tol = case(shape, dtype, integer, seed=1000 * rank + shape[0], tp=tp, dev=dev, group=group)
                ok = torch.tensor(float(worst <= tol), device=dev)
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                failed += ok.item() < 1
                if rank == 0:
                    print(f"tp={tp} {tuple(shape)} {str(dtype).removeprefix('torch.')} "
                          f"{'integers' if integer else 'normal'}: max |ce - nccl| / max |nccl| on rank 0 {worst:.3g} "
                          f"(tolerance {tol:.3g}) {'ok' if ok.item() else 'MISMATCH on some rank'}", flush=True)
    if rank == 0:
        print(f"ce_reduce_scatter against NCCL at tp={tp}: {'all match' if not failed else f'{failed} cases differ'}")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
