"""Host time a step by kind, from run.sh's py-spy recordings (a LAYOUT@spy job) of ranks 0 and 2.

    tar xzf call2/logs.tgz -C /tmp/spy
    python3 spy_breakdown.py /tmp/spy/pp2tp2_compile_graphs_keepweights_spy 392.1

The first argument is the recordings' prefix (PREFIX.spy.r0.json, PREFIX.spy.r2.json), the second
the row's step ms. Only the timed rounds count: the main thread's samples inside bench_train's
timed() at its rounds' lines, and the other threads' samples at the same positions. Each sample
goes to the innermost frame of a known library; a sample with no Python frame is C++ or idle
(py-spy ran without --native). The autograd thread runs the backward while the main thread waits
for it ('waits for the autograd thread').
"""
import collections
import json
import sys

CATS = [("cudagraph replay", "torch/cuda/graphs.py"), ("cudagraph trees (Python)", "cudagraph_trees.py"),
        ("FSDP hooks", "fsdp/"), ("DTensor", "distributed/tensor/"), ("optimizer", "torch/optim/"),
        ("clip/grad norm", "clip_grad"), ("p2p/pipelining", "distributed/pipelining/"),
        ("c10d / functional collectives", "distributed_c10d.py"),
        ("c10d / functional collectives", "_functional_collectives"),
        ("dynamo / aot wrappers", "torch/_dynamo/"), ("dynamo / aot wrappers", "_aot_autograd/"),
        ("dynamo / aot wrappers", "torch/_inductor/"), ("meshtron", "meshtron/"),
        ("autograd (python)", "torch/autograd/"), ("torch.nn", "torch/nn/")]
ROUNDS_FROM_LINE = 331   # bench_train.py's timed(): the rounds' loop starts here (the warm-up's is above)


def category(stack, frames):
    for i in reversed(stack):
        f = frames[i].get("file", "")
        for name, key in CATS:
            if key in f:
                return name
    return "other python"


def main(prefix: str, step_ms: float) -> None:
    for r in (0, 2):
        with open(f"{prefix}.spy.r{r}.json", "rb") as f:
            d = json.loads(f.read().decode("utf-8", "replace"))
        frames = d["shared"]["frames"]
        main = next(p for p in d["profiles"] if "MainThread" in p["name"])
        idx = [k for k, s in enumerate(main["samples"])
               if any(frames[i]["name"] == "timed" and frames[i].get("line", 0) >= ROUNDS_FROM_LINE for i in s)]
        lo, hi = idx[0], idx[-1]
        n = hi - lo + 1
        print(f"rank {r}: ms a step (a step {step_ms} ms), from {n} samples of the main thread in the timed rounds")
        for p in d["profiles"]:
            off = len(p["samples"]) - len(main["samples"])
            samples = p["samples"][lo + off:hi + 1 + off]
            name = p["name"].split('"')[1]
            if all(not s for s in samples) or name in ("tqdm_monitor", "InductorSubproc", "subproc_worker_timer"):
                continue
            c = collections.Counter()
            for s in samples:
                if not s:
                    c["no Python frame (C++ or idle)"] += 1
                elif frames[s[-1]]["name"] == "_engine_run_backward":
                    c["waits for the autograd thread"] += 1
                elif frames[s[-1]]["name"] == "synchronize":
                    c["waits for the GPU (synchronize)"] += 1
                else:
                    c[category(s, frames)] += 1
            print("  ", "main" if name == "MainThread" else "autograd",
                  {k: round(v / n * step_ms, 1) for k, v in c.most_common()})


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
