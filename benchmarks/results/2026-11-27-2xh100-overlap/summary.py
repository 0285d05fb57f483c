"""The table of run.sh's rows: python summary.py all.jsonl [torchtitan suite.jsonl]"""
import json
import sys


def rows(path):
    try:
        return [json.loads(x) for x in open(path) if x.strip()]
    except OSError:
        return []


ours = rows(sys.argv[1])
peer = [r for r in (rows(sys.argv[2]) if len(sys.argv) > 2 else []) if r.get("tokens_per_s_per_gpu")]
tt = peer[0]["tokens_per_s_per_gpu"] if peer else None
print("| layout | experiment | step ms (rounds) | tokens/s/GPU | MFU | compute | NCCL | all-to-all | all-gather "
      "| exposed comm | exposed / NCCL | GPU idle | peak GiB | vs torchtitan eager |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in ours:
    if "error" in r or "step_ms" not in r:
        print(f"| {r.get('layout')} | failed: {str(r.get('error'))[:300]} |")
        continue
    p = r.get("profile") or {}
    busy = p.get("gpu_busy_ms")
    idle = f"{r['step_ms'] - busy:.1f}" if busy is not None else ""
    ratio = f"{r['tokens_per_s_per_gpu'] / tt:.3f}" if tt else ""
    lo, hi = min(r["step_ms_rounds"]), max(r["step_ms_rounds"])
    share = f"{p['exposed_comm_ms'] / p['nccl_ms']:.0%}" if p.get("nccl_ms") else ""

    def ms(k, p=p):
        return f"{p[k]:.1f}" if k in p else ""
    print(f"| {r['layout']} | {r.get('experiment') or ''} | {r['step_ms']:.1f} ({lo:.0f}-{hi:.0f}) | "
          f"{r['tokens_per_s_per_gpu']:,.0f} | {100 * (r['mfu'] or 0):.1f}% | {ms('compute_busy_ms')} | "
          f"{ms('nccl_ms')} | {ms('nccl_SendRecv_ms')} | {ms('nccl_AllGather_ms')} | {ms('exposed_comm_ms')} | "
          f"{share} | {idle} | {max(r['peak_mem_gib_ranks']):.1f} | {ratio} |")
for r in ours:
    if "step_ms" in r:
        print(f"{r['layout']} {r.get('experiment') or ''}: {r['device']}, torch {r['torch']}, losses "
              f"{r.get('losses', [])[:4]}, load {r.get('expert_load_timed_max')}, "
              f"profile {json.dumps(r.get('profile'))}")
for r in peer:
    print(f"torchtitan {r['name']}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {r.get('mfu')}, "
          f"windows {r.get('tps_windows')}")
