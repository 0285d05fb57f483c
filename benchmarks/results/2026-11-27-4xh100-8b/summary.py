"""Compact tables of run.sh's rows: python summary.py all.jsonl [tt_steps.txt]
(torchtitan: the median of its 5-step windows after the first two, tokens/s per GPU)."""
import json
import re
import statistics
import sys

PEAK, FLOPS_TOKEN = 989e12, None
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
for r in rows:
    print(f"== {r['layout']} | {r.get('flags')}")
    if "error" in r:
        print("   ERROR", r["error"][:400])
        continue
    FLOPS_TOKEN = r["tflops_per_gpu"] * 1e12 / r["tokens_per_s_per_gpu"]
    print(f"   step {r['step_ms']:.1f} ms (rounds {' '.join(f'{x:.1f}' for x in r['step_ms_rounds'])}), "
          f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU {100 * (r['mfu'] or 0):.1f}%, "
          f"warmup {r['warmup_s']:.1f} s, build {r['build_s']:.1f} s, peak alloc {max(r['peak_mem_gib_ranks']):.1f} "
          f"reserved {r['peak_reserved_gib']:.1f} GiB, loss {r['loss_first']} -> {r['loss_last']}")
    p = r.get("profile") or {}
    if p:
        print("   profile ms/step: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in p.items()))
print(f"   flops/token {FLOPS_TOKEN}")
if len(sys.argv) > 2:
    by = {}
    for line in open(sys.argv[2]):
        m = re.search(r"step:\s*(\d+).*?tps:\s*([\d,]+)", line)
        if m:
            by.setdefault("tt", []).append((int(m.group(1)), int(m.group(2).replace(",", ""))))
    text = open(sys.argv[2]).read()
    print(text[-3000:])
    # the step files are concatenated in run order: split on step numbers restarting
    runs, cur, last = [], [], 0
    for s, t in by.get("tt", []):
        if s <= last:
            runs.append(cur)
            cur = []
        cur.append((s, t))
        last = s
    runs.append(cur)
    for run in runs:
        w = [t for s, t in run if s > 10]
        if w:
            med = statistics.median(w)
            mfu = f", MFU {100 * med * FLOPS_TOKEN / PEAK:.1f}% (meshtron's count)" if FLOPS_TOKEN else ""
            print(f"torchtitan windows after step 10: {w} median {med:,.0f}{mfu}")
