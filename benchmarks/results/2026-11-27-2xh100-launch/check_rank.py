"""A rank under the launcher: what its process got (forked with torch imported, or a
fresh interpreter), its CUDA device, and whether the allocator took the
expandable-segments setting the script made before importing torch (as recipes/train.py does)."""
import os
import sys

preloaded = "torch" in sys.modules
os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
x = torch.ones(64 << 20, device="cuda")   # 256 MiB: a segment of its own
dist.all_reduce(x)
segments = torch.cuda.memory._snapshot()["segments"]
ok = x[0].item() == dist.get_world_size()
print(f"rank {rank} preloaded={preloaded} device={torch.cuda.get_device_name()} sum_ok={ok} "
      f"expandable={sorted({s.get('is_expandable') for s in segments})}", flush=True)
dist.destroy_process_group()
