"""The parallelism's names that the command line offers, and its check of the mesh
degrees, without torch.

meshtron.config parses and checks the flags before anything imports torch (which
takes seconds on every rank), so a mistake is reported at once. The modules that
act on these names (mesh, data_parallel, pipeline_parallel, recompute, float8)
import them from here, so each list is written once.
"""
AXES = ("dp", "pp", "cp", "tp", "ep")
"""the mesh's axes, outermost to innermost (mesh.py says why in this order)"""
DTYPES = ("fp32", "bf16", "fp16")
"""compute and gradient-reduction dtypes (data_parallel.DTYPES maps them to torch's)"""
FP8_RECIPES = ("none", "tensorwise", "rowwise")
"""FP8 scaling recipes (float8.py)"""
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
"""pipeline schedules (pipeline_parallel.SCHEDULES maps them to torch's classes)"""
MULTI_STAGE = {"interleaved-1f1b", "zero-bubble", "zbv"}
"""the schedules that run several stages per pp rank"""
SPLIT_BACKWARD = {"zero-bubble", "zbv"}
"""the schedules that compute weight gradients apart from input gradients (the W steps), outside FSDP's
backward hooks: with ZeRO 3 (parameters resharded after each forward) torch 2.13 loses some stages'
weight gradients, so the config refuses the pair"""
RECOMPUTE_MODES = ("none", "full", "selective")
"""activation recomputation (recompute.py)"""


def resolve_degrees(world_size: int, dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1,
                    ep: int = 1) -> dict[str, int]:
    """Check the five degrees against the world size; dp=-1 takes what is left."""
    degrees = dict(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
    for name, d in degrees.items():
        if not isinstance(d, int) or (d < 1 and not (name == "dp" and d == -1)):
            raise ValueError(f"parallel degree {name}={d} must be a positive integer"
                             + (" (or -1 for dp)" if name == "dp" else ""))
    rest = pp * cp * tp * ep
    if dp == -1:
        if world_size % rest:
            alone = _one_process(rest, "(or a multiple) ") if world_size == 1 else ""
            raise ValueError(f"pp*cp*tp*ep = {pp}*{cp}*{tp}*{ep} = {rest} does not divide the world size "
                             f"{world_size}{alone}")
        degrees["dp"] = world_size // rest
    if degrees["dp"] * rest != world_size:
        hint = ""
        if world_size == 1:
            hint = _one_process(dp * rest)
        elif world_size % rest == 0:
            hint = f": with the other degrees as given, --dp {world_size // rest} fits"
            if ep > 1 and dp > 1:   # torchtitan and Megatron carve ep out of the data-parallel ranks
                hint += (f" (ep is an axis of its own here, not a part of dp: the batch is split over dp x ep, so "
                         f"their --dp {world_size // rest * ep} --ep {ep} is --dp {world_size // rest} "
                         f"--ep {ep})")
        raise ValueError(
            f"mesh dp*pp*cp*tp*ep = {degrees['dp']}*{pp}*{cp}*{tp}*{ep} = {degrees['dp'] * rest} "
            f"does not equal the world size {world_size}{hint}"
        )
    return degrees


def _one_process(ranks: int, multiple: str = "") -> str:
    """The hint for a layout of several ranks in a world of one: most often a script started without the
    launcher, which no degree of one process would fix."""
    return (f": this is one process; start {ranks} ranks {multiple}with the launcher in front of the same command, "
            f"meshtron-run --nproc-per-node {ranks} SCRIPT FLAGS")


def default_dtype(device_type: str, fp8: str = "none") -> str:
    """The compute dtype of a run that names none: bf16 on a GPU, whose tensor cores make it
    the fast mode (fp32 runs there at a tenth of the rate), and around FP8's matmuls; fp32 on
    the CPU, where bf16 is no faster."""
    return "bf16" if device_type == "cuda" or fp8 != "none" else "fp32"
