"""The EP=2 all-to-all's transfer floor for llama-moe-3B at 4 x 2048 tokens a rank (top-2, dim 2048, bf16):
all_to_all_single of 16,384 rows x 2048 on an idle pair of GPUs, even and uneven splits, CUDA-event
medians; and the host round trip of the count exchange (a 16-int all-to-all, then .tolist()).
torchrun --nproc-per-node 2 a2a_floor.py"""
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
r, w = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
rows, dim = 4 * 2048 * 2, 2048
out = {}
for name, share in (("even", 0.5), ("busiest 1.7x", 0.85)):   # share of each rank's copies sent to rank 1
    send = [rows - int(rows * share), int(rows * share)]       # to rank 0, to rank 1
    recv_all = torch.tensor(send, device="cuda")
    gathered = [torch.empty_like(recv_all) for _ in range(w)]
    dist.all_gather(gathered, recv_all)
    recv = [int(g[r]) for g in gathered]
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(sum(recv), dim, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(30):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dist.all_to_all_single(y, x, recv, send)
        b.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b))
    out[f"a2a_{name}_ms"] = statistics.median(times)
    out[f"a2a_{name}_recv_rows"] = sum(recv)
c = torch.arange(16, device="cuda", dtype=torch.int64)
got = torch.empty_like(c)
host = []
for i in range(50):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dist.all_to_all_single(got, c)
    got.tolist()
    if i >= 10:
        host.append((time.perf_counter() - t0) * 1e3)
out["count_exchange_tolist_ms"] = statistics.median(host)
res = [None] * w
dist.all_gather_object(res, out)
if r == 0:
    line = json.dumps({"rank_results": res, "per_step_floor_even_ms (48 a2a: 12 layers x dispatch+combine, fwd+bwd)":
                       48 * max(x["a2a_even_ms"] for x in res)})
    print(line)
    with open(os.path.join(os.environ.get("R", "/tmp"), "a2a_floor.jsonl"), "a") as f:
        f.write(line + "\n")
dist.destroy_process_group()
