"""A graph step recorded for a device (tests/fake_device.py says how, without a GPU): nothing
of the program is on the host, nothing reads the host, and its collectives are the ones
the same step records on the CPU, one for one.

On a device the recorded program becomes one captured graph, which runs none of its host
work again: a host step count would freeze the learning-rate schedule and the bias
corrections at their values of the recording.
"""

import json
import os
import sys

import pytest
import torch

from procs import run_in_session

HERE = os.path.dirname(__file__)

# (world, replicate, strategy, optimizer, plan options): each recorded on the device and on the CPU
CONFIGS = [
    (2, None, "FULL_SHARD", "adamw_schedule", []),
    (2, None, "SHARD_GRAD_OP", "sgd", ["buckets"]),
    (2, None, "NO_SHARD", "muon", []),
    (2, None, "SHARD_OPTIMIZER", "adamw_schedule", ["bf16"]),
    # (remat is left out: its recompute aborts the process on torch's Python-backed device,
    # "terminate called without an active exception", in autograd's device thread)
    (4, None, "FULL_SHARD", "adamw_schedule", ["bf16"]),
    (4, 2, "HYBRID_SHARD", "adamw_schedule", ["buckets"]),
]


def _record_all(configs: list[dict]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    code, out, err = run_in_session([sys.executable, os.path.join(HERE, "fake_device.py"), json.dumps(configs)],
                                    cwd=HERE, env=env, timeout=300)
    assert code == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def recorded():
    configs = []
    for world, replicate, strategy, optimizer, options in CONFIGS:
        for device in ("gpu", "cpu"):
            # rank 1 holds the last shard (the padding): its offsets differ from rank 0's
            configs.append(dict(world=world, rank=1, strategy=strategy, optimizer=optimizer, options=options,
                                device=device, replicate=replicate))
    results = _record_all(configs)
    assert len(results) == len(configs)
    return {(c["world"], c["strategy"], c["optimizer"], c["device"]): r for c, r in zip(configs, results)}


@pytest.mark.parametrize("world,replicate,strategy,optimizer,options", CONFIGS,
                         ids=[f"{c[2]}-{c[0]}-{c[3]}-{'+'.join(c[4]) or 'fp32'}" for c in CONFIGS])
def test_a_program_recorded_for_a_device_holds_nothing_of_the_host(recorded, world, replicate, strategy, optimizer,
                                                                   options):
    on_device = recorded[(world, strategy, optimizer, "gpu")]
    on_cpu = recorded[(world, strategy, optimizer, "cpu")]
    assert "error" not in on_device, on_device["error"]
    assert "error" not in on_cpu, on_cpu["error"]
    assert on_device["host"] == []  # every input, constant and result is on the device
    assert on_device["host_reads"] == []
    assert on_device["collectives"], "a program of a world > 1 communicates"
    assert on_device["collectives"] == on_cpu["collectives"]  # kind, axis, shape, dtype and bytes, in order


class _Mesh:
    """What jit_step(graph=...) asks of a mesh when it is built."""

    def __init__(self, device, backend):
        self.device, self.backend = torch.device(device), backend

    def axis_size(self, axis):
        return 1  # no tensor axis


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_graph_steps_on_cuda_are_refused_as_unverified_unless_asked_for(monkeypatch, backend):
    from shardfn._jit import _check_graph

    monkeypatch.delenv("SHARDFN_CUDA_GRAPH", raising=False)
    with pytest.raises(ValueError) as caught:
        _check_graph(True, _Mesh("cuda", backend), True, None, None, False)
    if backend == "gloo":  # refused whatever the variable says
        assert "the mesh runs gloo over CUDA tensors" in str(caught.value)
        monkeypatch.setenv("SHARDFN_CUDA_GRAPH", "1")
        with pytest.raises(ValueError, match="which a CUDA graph cannot capture"):
            _check_graph(True, _Mesh("cuda", backend), True, None, None, False)
        return
    assert "a recorded step on a device is unverified" in str(caught.value)
    assert "SHARDFN_CUDA_GRAPH=1" in str(caught.value) and "benchmarks/gpu_check.py --graph" in str(caught.value)
    monkeypatch.setenv("SHARDFN_CUDA_GRAPH", "1")
    _check_graph(True, _Mesh("cuda", backend), True, None, None, False)  # built
    _check_graph(True, _Mesh("cpu", "gloo"), True, None, None, False)  # the CPU needs no variable
