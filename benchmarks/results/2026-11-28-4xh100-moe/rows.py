"""The call script's rows: 2026-11-27's rows.py (peer, merge, summary) and `balance`.

    python rows.py peer R/TAG NAME VARIANT WORLD STEPS_FILE   # a peer run through .peer/run.sh: a suite-like row
    python rows.py merge OUT.jsonl R                          # every R/*/suite.jsonl, each row tagged by its folder
    python rows.py summary OUT.jsonl                          # the table
    python rows.py balance BALANCE.out                        # moe_balance.py's rank-0 lines: load by layer
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-11-27-4xh100-rows"))
import rows as rows_1127  # noqa: E402


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
    {"peer": rows_1127.peer, "merge": rows_1127.merge, "summary": rows_1127.summary,
     "balance": balance}[sys.argv[1]](*sys.argv[2:])
