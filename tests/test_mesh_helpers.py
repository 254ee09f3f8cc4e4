"""The mesh's collectives for the training loop: barrier, broadcast, reduce, all_gather
(Lightning's strategy.barrier / broadcast / reduce / all_gather), over 1-D and 2-D meshes."""

import pytest
import torch

import shardfn as sf


def helpers(replicate=None, src=1):
    mesh = sf.Mesh.from_group(replicate=replicate)
    r = mesh.rank
    with sf.record_collectives() as log:
        mesh.barrier()
        config = mesh.broadcast({"lr": 0.1 * (r + 1), "files": [f"part-{r}"], "t": torch.arange(3) + r}, src=src)
        mean = mesh.reduce(torch.tensor([float(r), 2.0 * r]))
        total = mesh.reduce(torch.tensor(r + 1), "sum")
        imean = mesh.reduce(torch.tensor(r), "mean")
        hi, lo = mesh.reduce(torch.tensor(r), "max"), mesh.reduce(torch.tensor(r), "min")
        every = mesh.all_gather(torch.full((2, 3), float(r)))
    return {"config": config, "mean": mean, "total": total, "imean": imean, "hi": hi, "lo": lo, "every": every,
            "purposes": sorted({c.purpose.value for c in log.calls}), "calls": len(log.calls)}


def mismatched_all_gather():
    mesh = sf.Mesh.from_group()
    shape = (2, 3) if mesh.rank == 0 else (3, 2)  # the same bytes, another shape
    try:
        mesh.all_gather(torch.zeros(shape))
    except sf.DivergenceError as e:
        first = str(e)
    try:
        mesh.all_gather(torch.zeros(mesh.rank + 1))
    except sf.DivergenceError as e:
        return first, str(e), mesh.reduce(torch.tensor(1.0), "sum")  # the ranks are still in step


@pytest.mark.parametrize(("world", "replicate"), [(2, None), (3, None), (4, 2)])
def test_barrier_broadcast_reduce_all_gather(clusters, world, replicate):
    outs = clusters[world].run(helpers, replicate)
    for out in outs:
        assert out["config"]["lr"] == pytest.approx(0.2) and out["config"]["files"] == ["part-1"]
        assert torch.equal(out["config"]["t"], torch.arange(3) + 1)
        ranks = torch.arange(world, dtype=torch.float64)
        torch.testing.assert_close(out["mean"], torch.tensor([ranks.mean().item(), 2 * ranks.mean().item()]))
        assert out["total"].item() == world * (world + 1) // 2 and out["total"].dtype == torch.int64
        assert out["imean"].item() == pytest.approx(ranks.mean().item())
        assert (out["hi"].item(), out["lo"].item()) == (world - 1, 0)
        assert out["every"].shape == (world, 2, 3)
        assert all(torch.equal(out["every"][r], torch.full((2, 3), float(r))) for r in range(world))
        assert out["purposes"] == ["user"] and out["calls"] > 0


def test_all_gather_of_other_shapes_raises_on_every_rank(clusters):
    outs = clusters[2].run(mismatched_all_gather)
    for same_bytes, other_bytes, after in outs:
        assert "mesh.barrier, broadcast, reduce and all_gather are collective" in same_bytes
        assert "rank 0: all_gather (user), 8 bytes float32" in other_bytes
        assert "rank 1: all_gather (user), 16 bytes float32" in other_bytes
        assert after.item() == 2.0


def test_a_world_of_one_needs_no_peer(clusters):
    out = clusters[1].run(helpers, None, 0)[0]
    assert out["config"]["lr"] == pytest.approx(0.1) and torch.equal(out["config"]["t"], torch.arange(3))
    assert out["mean"].tolist() == [0.0, 0.0] and out["total"].item() == 1 and out["calls"] == 0
    assert out["every"].shape == (1, 2, 3)


def bad_src():
    mesh = sf.Mesh.from_group()
    with pytest.raises(ValueError, match="src must be a mesh rank, 0 to 1"):
        mesh.broadcast(1, src=2)
    with pytest.raises(ValueError, match="op must be one of"):
        mesh.reduce(torch.zeros(1), "avg")
    return True


def test_bad_arguments_are_clear(clusters):
    assert clusters[2].run(bad_src) == [True, True]
