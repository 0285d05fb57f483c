"""The call scripts' rows: one results.jsonl and a compact table.

    python rows.py peer R/TAG NAME VARIANT WORLD STEPS_FILE   # a peer run through .peer/run.sh: a suite-like row
    python rows.py merge OUT.jsonl R                          # every R/*/suite.jsonl, each row tagged by its folder
    python rows.py summary OUT.jsonl                          # the table
    python rows.py balance BALANCE.out                        # moe_balance.py's rank-0 lines: load by layer

A peer's tokens/s here is the median of its 5-step windows logged at steps 10, 15, ... (the lines at step 1
and step 5 hold start-up and compilation), taken from its full step log R/TAG.steps.
"""
import glob
import json
import os
import re
import statistics
import sys

PEAK = 989e12


def windows(path):
    out = []
    for line in open(path, errors="replace"):
        m = re.search(r"step:\s*(\d+)\s+loss.*?tps:\s*([\d,]+)", line)
        if m:
            out.append((int(m.group(1)), float(m.group(2).replace(",", ""))))
    return out


def peer(folder, name, variant, world, steps):
    os.makedirs(folder, exist_ok=True)
    w = windows(steps) if os.path.exists(steps) else []
    row = dict(name=name, world=int(world), peer_variant=variant, rc=0 if w else 1, tps_windows=[t for _, t in w],
               tokens_per_s_per_gpu=statistics.median([t for _, t in w[1:]]) if w[1:] else None)
    with open(os.path.join(folder, "suite.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def merge(out, r):
    rows = []
    for path in sorted(glob.glob(os.path.join(r, "*", "suite.jsonl")), key=os.path.getmtime):
        tag = os.path.basename(os.path.dirname(path))
        for line in open(path):
            if not line.strip():
                continue
            row = json.loads(line)
            row["tag"] = tag
            steps = os.path.join(r, tag + ".steps")
            if "peer_variant" in row and os.path.exists(steps):
                w = windows(steps)
                row["tps_windows_all"] = w
                late = [t for s, t in w if s >= 10]
                row["tokens_per_s_per_gpu_suite"] = row.get("tokens_per_s_per_gpu")
                row["tokens_per_s_per_gpu"] = statistics.median(late) if late else None
                row["peer_rule"] = "median of the 5-step windows logged at steps >= 10"
            rows.append(row)
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def summary(path):
    rows = [json.loads(x) for x in open(path) if x.strip()]
    peers = {}
    for r in rows:
        if "peer_variant" in r:
            peers[r["name"]] = r
    for r in rows:
        tps = r.get("tokens_per_s_per_gpu")
        if "peer_variant" in r:
            w = " ".join(f"{s}:{t:,.0f}" for s, t in r.get("tps_windows_all", []))
            print(f"[{r['tag']}] PEER {r['name']} ({r['peer_variant']}): rc={r.get('rc')} "
                  f"{(tps or 0):,.0f} tok/s/GPU (suite's own {r.get('tokens_per_s_per_gpu_suite')}); windows {w}")
            continue
        head = f"[{r['tag']}] {r['name']} | {r.get('flags')}"
        if not tps:
            print(f"{head}\n   FAILED rc={r.get('rc')} {str(r.get('error', ''))[:600]}")
            continue
        ftok = r["tflops_per_gpu"] * 1e12 / tps
        p = r.get("profile") or {}
        prof = " / ".join(f"{p[k]:.1f}" for k in ("compute_busy_ms", "nccl_ms", "exposed_comm_ms") if k in p)
        print(f"{head}\n   step {r['step_ms']:.1f} ms (rounds {' '.join(f'{x:.1f}' for x in r['step_ms_rounds'])}), "
              f"{tps:,.0f} tok/s/GPU, MFU {100 * r['mfu']:.1f}%, flop/token {ftok / 1e9:.2f} G, "
              f"peak alloc {max(r['peak_mem_gib_ranks']):.1f} / reserved {r['peak_reserved_gib']:.1f} GiB, "
              f"build {r['build_s']:.0f} s warmup {r['warmup_s']:.1f} s, loss {r['loss_first']} -> {r['loss_last']}"
              + (f", expert load timed max {r['expert_load_timed_max']} (router's own "
                 f"{r.get('router_load_timed_max')})" if "expert_load_timed_max" in r else ""))
        if prof:
            print(f"   profile compute / NCCL / exposed ms: {prof}")
        for name, pr in peers.items():
            if pr.get("tokens_per_s_per_gpu") and r.get("peer") and name.startswith(r["peer"]):
                pt = pr["tokens_per_s_per_gpu"]
                print(f"   against {name}: {pt:,.0f} tok/s/GPU (MFU {100 * pt * ftok / PEAK:.1f}% at meshtron's "
                      f"count) -> ratio {tps / pt:.3f}")


def balance(path):
    """moe_balance.py's per-step lines: the worst layer (as run, the router's own) at steps 1, 10, 20, ...
    and the last, then each layer at the last step."""
    steps = {}
    for line in open(path, errors="replace"):
        m = re.search(r"step\s+(\d+) \| loss ([\d.]+) \| load max/mean by layer ([\d. ]+?)"
                      r"(?: \| router's own ([\d. ]+?))? \| bias spread", line)
        if m:
            own = [float(x) for x in (m.group(4) or "").split()]
            steps[int(m.group(1))] = (float(m.group(2)), [float(x) for x in m.group(3).split()], own)
    if not steps:
        print(f"balance: no step lines in {path}")
        return
    last = max(steps)
    for s in sorted(steps):
        if s == 1 or s % 10 == 0 or s == last:
            loss, run, own = steps[s]
            print(f"step {s:>3}: loss {loss:.4f}, worst layer {max(run):.2f} "
                  f"(router's own {max(own) if own else 0:.2f})")
    tail = [steps[s][1] for s in sorted(steps)[-10:]]
    print(f"step {last} by layer: {' '.join(f'{x:.2f}' for x in steps[last][1])}")
    print(f"steps {last - len(tail) + 1}-{last}, worst layer of each step: {' '.join(f'{max(r):.2f}' for r in tail)}")


if __name__ == "__main__":
    {"peer": peer, "merge": merge, "summary": summary, "balance": balance}[sys.argv[1]](*sys.argv[2:])
