
import pytest
import torch.distributed as dist

from meshtron import AXES, degree, init_mesh, submesh
from meshtron.distributed.mesh import resolve_degrees

from harness import mesh

LAYOUTS_8 = [
    dict(dp=8),
    dict(dp=-1, tp=2),
    dict(dp=2, pp=2, tp=2),
    dict(dp=1, pp=2, cp=2, tp=2),
    dict(dp=2, cp=2, ep=2),
    dict(dp=2, pp=2, cp=1, tp=1, ep=2),
    dict(dp=1, pp=1, cp=1, tp=8),
]


def _shapes(rank, world, degrees):
    m = mesh(**degrees)
    # every rank checks that sub-mesh groups contain exactly the ranks that
    # differ only along those axes, by summing ranks inside each group
    out = {"names": m.mesh_dim_names, "shape": tuple(m.shape)}
    for name in AXES + ("batch", "dense_dp", "expert_dp", "loss"):
        sm = submesh(m, name)
        out[name] = (sm.size(), sorted(sm.mesh.flatten().tolist()))
    return out


@pytest.mark.parametrize("degrees", LAYOUTS_8, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_mesh_shapes_on_8_ranks(pools, degrees):
    results = pools.run(8, _shapes, degrees)
    full = resolve_degrees(8, **degrees)
    for rank, r in enumerate(results):
        assert r["names"] == ("dp", "pp", "cp", "tp", "ep")
        assert r["shape"] == tuple(full[a] for a in AXES)
        for a in AXES:
            assert r[a][0] == full[a]
        assert r["batch"][0] == full["dp"] * full["ep"]
        assert r["dense_dp"][0] == full["dp"] * full["cp"] * full["ep"]
        assert r["expert_dp"][0] == full["dp"] * full["cp"]
        assert r["loss"][0] == r["dense_dp"][0]
        # innermost axes are contiguous ranks: tp*ep consecutive ranks share a node
        inner = full["tp"] * full["ep"]
        tp_ep = sorted(set(r["tp"][1]) | set(r["ep"][1]))
        assert tp_ep == list(range(rank // inner * inner, rank // inner * inner + inner))
        for name in AXES + ("batch", "dense_dp", "expert_dp", "loss"):
            assert rank in r[name][1]


def _bad_layout(rank, world, degrees):
    # a DeviceMesh makes its groups with dist.new_group, a collective over the world:
    # a layout refused before any collective leaves the number of groups as it was
    groups = len(dist.distributed_c10d._world.pg_map)
    try:
        init_mesh(device_type="cpu", **degrees)
    except ValueError as e:
        return str(e), len(dist.distributed_c10d._world.pg_map) - groups
    return None, 0


BAD = [
    (dict(dp=3), "does not equal the world size 4: with the other degrees as given, --dp 4 fits"),
    # torchtitan's and Megatron's way of writing ep (issue 35)
    (dict(dp=4, ep=4), "does not equal the world size 4: with the other degrees as given, --dp 1 fits (ep is an "
                       "axis of its own here, not a part of dp: the batch is split over dp x ep, so their --dp 4 "
                       "--ep 4 is --dp 1 --ep 4)"),
    (dict(dp=-1, tp=3), "does not divide the world size 4"),
    (dict(dp=0, tp=4), "dp=0 must be a positive integer"),
    (dict(dp=2, pp=-2), "pp=-2 must be a positive integer"),
]


def test_bad_layouts_raise_on_every_rank_before_any_collective(pools):
    # what a model needs of the layout (heads divisible by tp, ...) its spec checks: tests/models
    for degrees, msg in BAD:
        results = pools.run(4, _bad_layout, degrees, timeout=20)
        for text, new_groups in results:
            assert text is not None and msg in text, (degrees, text)
            assert new_groups == 0
    # the pool's ranks are still in step: a collective after all those errors works
    assert pools.run(4, _all_reduce_ok) == [True] * 4


def _all_reduce_ok(rank, world):
    import torch
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == world


def test_resolve_degrees_without_a_world():
    assert resolve_degrees(16, dp=-1, pp=2, tp=4) == dict(dp=2, pp=2, cp=1, tp=4, ep=1)
    with pytest.raises(ValueError, match="tp=1.5"):
        resolve_degrees(4, tp=1.5)


def _size_one_axes_cost_nothing(rank, world):
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    from meshtron.distributed.reduce import grad_norm, mean_over
    m = mesh(dp=4)
    with CommDebugMode() as comm:
        loss = mean_over(torch.tensor(1.0), m, "loss")  # dp=4: one all-reduce
        norm = grad_norm([], m)                          # pp=1: none
    return comm.get_total_counts(), degree(m, "tp"), float(loss), float(norm)


def test_size_one_axes_issue_no_collectives(pools):
    for counts, tp, loss, norm in pools.run(4, _size_one_axes_cost_nothing):
        assert tp == 1 and loss == 1.0 and norm == 0.0
        assert counts == 1


def _flattened_once(rank, world):
    from meshtron.distributed.collectives import CollectiveCounter
    m = init_mesh(device_type="cpu", dp=2, cp=2, tp=2)   # a fresh mesh: none of its groups flattened yet
    first = submesh(m, "dense_dp")
    groups = len(dist.distributed_c10d._world.pg_map)
    again = [submesh(m, name) for name in ("dense_dp", "loss")]   # "loss" spans the same axes
    names = CollectiveCounter(m).names
    return (all(s is first for s in again), len(dist.distributed_c10d._world.pg_map) - groups,
            names.get(frozenset(dist.get_process_group_ranks(first.get_group()))),
            "_meshtron_flat" in m.__dict__)


def test_a_flattened_sub_mesh_is_made_once_and_kept_by_torch(pools):
    # torch keeps each flattened mesh with the root mesh by name: asking again returns it
    # and makes no process group; the collective counter names its group from the layout
    for same, new_groups, name, stamped in pools.run(8, _flattened_once):
        assert same and new_groups == 0 and name == "dp+cp" and not stamped


def test_hsdp_groups_are_named_by_their_place_in_the_dense_dp_group():
    from meshtron.distributed.collectives import _hsdp_name
    dense = [0, 2, 4, 6, 8, 10, 12, 14]   # one rank's dense dp group, in flattened order
    assert _hsdp_name(frozenset({8, 10, 12, 14}), dense) == "dp_shard"        # 2 replicas x 4 shards
    assert _hsdp_name(frozenset({2, 10}), dense) == "dp_replicate"
    assert _hsdp_name(frozenset({0, 2}), dense) == "dp_shard"                 # 4 replicas x 2 shards
    assert _hsdp_name(frozenset({2, 6, 10, 14}), dense) == "dp_replicate"
    for other in ({2, 4}, {0, 4}, {0, 1}, set(dense), {0}):   # unaligned, wrong stride, outside, whole, one
        assert _hsdp_name(frozenset(other), dense) is None, other
