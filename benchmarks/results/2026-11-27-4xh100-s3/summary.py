"""Compact tables of run.sh's rows: python summary.py all.jsonl [a2a_floor.jsonl]"""
import json
import sys

rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
for r in rows:
    print(f"== {r['layout']} | {r.get('flags')}")
    if "error" in r:
        print("   ERROR", r["error"][:400])
        continue
    print(f"   step {r['step_ms']:.1f} ms (rounds {' '.join(f'{x:.1f}' for x in r['step_ms_rounds'])}), "
          f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU {100 * (r['mfu'] or 0):.1f}%, "
          f"warmup {r['warmup_s']:.1f} s, build {r['build_s']:.1f} s, {r['device']}, torch {r['torch']}")
    print(f"   peak alloc GiB per rank {r['peak_mem_gib_ranks']}, reserved max {r['peak_reserved_gib']:.2f}")
    print(f"   built GiB {r.get('built_mem_gib_ranks')}, after step 1 {r.get('first_step_mem_gib_ranks')}")
    for i, ph in enumerate(r.get("memory_phases_gib_ranks") or []):
        print(f"   rank {i}: alloc at opt step {ph[0]:.2f}, fwd/bwd peak {ph[1]:.2f}, opt peak {ph[2]:.2f}, "
              f"alloc after opt {ph[3]:.2f}")
    if "expert_load_timed_max" in r:
        print(f"   expert load max/mean timed worst {r['expert_load_timed_max']}, "
              f"router's own {r['router_load_timed_max']}"
              f", balanced {r['balanced_routing']}, batch_balance {r['batch_balance']}")
    p = r.get("profile") or {}
    print("   profile ms/step: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in p.items()))
    if "bubble_measured" in r:
        print(f"   bubble predicted {r['bubble_predicted']:.3f} measured {r['bubble_measured']}")
print(f"   losses (first layout) {rows[0].get('losses', [])[:6]}")
if len(sys.argv) > 2:
    try:
        print(open(sys.argv[2]).read())
    except OSError:
        print("no a2a floor")
