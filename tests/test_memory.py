"""track_live_bytes: the live-tensor-bytes counter shared by tests, benchmarks and explain."""

import torch

import shardfn as sf


def test_counts_allocations_frees_and_the_peak():
    before = {"w": torch.zeros(1000)}  # 4000 B alive before the block
    with sf.track_live_bytes(before) as mem:
        assert mem.current == 4000
        a = torch.ones(500)  # +2000
        b = a * 2  # +2000: peak 8000
        view = b[10:].t()  # a view: no new storage
        del a
        assert mem.current == 6000
        del b
        assert mem.current == 6000  # the view keeps b's storage
        del view
        assert mem.current == 4000
    assert mem.peak == 8000


def test_storage_resizes_are_recounted():
    with sf.track_live_bytes() as mem:
        t = torch.empty(256)
        t.untyped_storage().resize_(0)  # how FSDP2 frees a gathered parameter
        assert mem.current == 0
        t.untyped_storage().resize_(4 * 256)
        assert mem.current == 1024
    assert torch.UntypedStorage.resize_.__name__ == "resize_"  # the wrapper is gone after the block


def dtensor_bytes():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
    with sf.track_live_bytes(d) as mem:
        held = mem.current
        e = d * 2  # a DTensor op: its output's local shard is what is allocated
        grown = mem.current - held
        del e
    return held, grown, d.to_local().numel() * 4


def test_a_dtensor_counts_as_its_local_shard(clusters):
    for held, grown, local in clusters[2].run(dtensor_bytes):
        assert held == local == 64 * 8 * 4 // 2 and grown == local


def header_exchange_bytes():
    """The live bytes of one schedule-guard header exchange (an all-reduce of the header's
    int64 words and their negation over the gloo control group)."""
    from shardfn._comm import guard as G

    mesh = sf.Mesh.from_group()
    with sf.track_live_bytes() as mem:
        headers = G.exchange(mesh.channel("shard"), [0] * G.HEADER, "a test", G.Scope())
    return mem.peak, mem.device_peak, mem.host_peak, len(headers)


def test_the_guards_headers_are_host_memory(clusters):
    # They live in host memory whatever the device (gloo); counted as device memory, a header
    # exchange that fell on a step's peak added its bytes to the device peak in some runs. Ranks
    # that agree hold one buffer of 2 x 7 words, whatever the world ([Note: a fixed-size agreement]).
    for peak, device_peak, host_peak, n in clusters[2].run(header_exchange_bytes):
        assert n == 2 and peak == host_peak == 2 * 7 * 8 and device_peak == 0
