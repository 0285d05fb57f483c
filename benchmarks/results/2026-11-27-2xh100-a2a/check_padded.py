"""The padded dispatch on the GPU against the exact one, one MoE block at ep=2 in bf16
(torch._grouped_mm, whose rows past the last offset are left unwritten: the allocator's
cached memory is filled with NaN first), the router's own routing and a rank that
receives no tokens; its forward and backward under torch.cuda.set_sync_debug_mode("error")
(any host sync raises); and one block's forward + backward time, both dispatches.
torchrun --nproc-per-node 2 check_padded.py  (writes $OUT/check_padded.json on rank 0)"""
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from meshtron.distributed.expert_parallel import apply_moe  # noqa: E402
from meshtron.distributed.mesh import init_mesh  # noqa: E402
from meshtron.models.common.moe import MoE, MoEConfig  # noqa: E402

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
mesh = init_mesh(device_type="cuda", dp=1, ep=2)
dim = 2048
cfg = MoEConfig(n_experts=16, top_k=2, hidden=2048)
out = {}


def block(dispatch, banned):
    torch.manual_seed(0)
    m = MoE(dim, cfg).cuda()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    m.router.expert_bias[list(banned)] = float("-inf")
    apply_moe([m], mesh, dispatch)
    return m


def run(m, x, sync_check=False):
    m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        y = m(x)   # bf16 tokens, fp32 weights: the router in fp32, the experts' GEMMs in bf16
        (y.float() * 1e-2).square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [t.detach().float() for t in [y, x.grad, m.router.gate.weight.grad]
            + [p.grad.to_local() for p in m.experts.parameters()]]


for name, banned in (("router's own", ()), ("rank 1 receives nothing", tuple(range(8, 16)))):
    x = torch.randn(4, 2048, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(rank)).bfloat16()
    exact = run(block("exact", banned), x)
    padded = block("padded", banned)
    poison = torch.full((3 << 28,), float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison   # cached: the next allocations reuse NaN-filled memory
    try:
        got, sync = run(padded, x, sync_check=True), "none"
    except RuntimeError as e:
        got, sync = run(padded, x), str(e).splitlines()[0]
    err = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, exact)]
    out[name] = dict(rel_err=err, finite=all(bool(t.isfinite().all()) for t in got), host_sync=sync)
    try:
        run(block("exact", banned), x, sync_check=True)
        out[name]["exact_host_sync"] = "none"
    except RuntimeError as e:
        out[name]["exact_host_sync"] = str(e).splitlines()[0]

x = torch.randn(4, 2048, dim, device="cuda").bfloat16()
for dispatch in ("exact", "padded"):
    m, times = block(dispatch, ()), []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(m, x)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    out[f"{dispatch} block fwd+bwd ms"] = statistics.median(times)
out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
if rank == 0:
    line = json.dumps(out)
    print(line)
    with open(os.path.join(os.environ.get("OUT") or "/tmp", "check_padded.json"), "w") as f:
        f.write(line + "\n")
dist.destroy_process_group()
