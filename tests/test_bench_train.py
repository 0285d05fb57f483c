"""benchmarks/bench_train.py's profile summary on synthetic kernel intervals."""
import importlib.util
import pathlib

spec = importlib.util.spec_from_file_location(
    "bench_train", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py")
bench_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_train)


def test_stage_busy_counts_tp_collectives_not_pipeline_recv():
    kernels = [("sm90_xmma_gemm_bf16", 0, 10),
               ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 10, 20),   # TP: the stage's
               ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, 50),   # waiting for the other stage
               ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 45, 55),   # overlaps the recv's end
               ("triton_poi_fused_add_0", 52, 60),
               ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 58, 70)]   # its start under compute
    assert bench_train.stage_busy(kernels) == 10 + 10 + 15
    assert bench_train.stage_busy([k for k in kernels if "SendRecv" in k[0]]) == 0


def test_profile_writes_the_timeline_when_asked(tmp_path):
    import gzip
    import json

    import torch
    x = torch.randn(64, 64)
    trace = tmp_path / "trace_r0.json.gz"
    bench_train.profile(lambda i: x @ x, 1, torch.device("cpu"), str(tmp_path / "profile.txt"), str(trace))
    names = {e.get("name") for e in json.load(gzip.open(trace))["traceEvents"]}
    assert "aten::mm" in names, sorted(n for n in names if n)[:20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.txt", "trace_r0.json.gz"]   # the raw file removed


def test_each_profiled_steps_idle_share_and_the_bubble_as_their_median():
    """step_idle: per step, from its first kernel to the next step's, the share no busy span
    covers (a bubble measured step by step, the median of them taken by bench_train.bubble)."""
    import statistics
    busy = [[0, 6], [8, 10], [10, 14], [20, 29]]
    steps = bench_train.step_idle(busy, [0, 10, 20], 30)
    assert steps == [0.2, 0.6, 0.1]     # 8 of 10 busy, 4 of 10, 9 of 10
    assert statistics.median(steps) == 0.2
    assert bench_train.step_idle(busy, [], 30) == []     # no step spans (a CPU profile): none


def test_the_profile_marks_each_step_and_keeps_its_figures_numbers_or_per_step_lists(tmp_path):
    import torch
    x = torch.randn(32, 32)
    p = bench_train.profile(lambda i: x @ x, 2, torch.device("cpu"), str(tmp_path / "profile.txt"))
    assert p["compute_idle_steps"] == [] and p["stage_idle_steps"] == []   # no GPU spans on the CPU
    assert all(isinstance(v, (int, float)) for k, v in p.items() if not k.endswith("_steps"))
