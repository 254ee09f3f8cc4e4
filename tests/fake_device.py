"""A graph step recorded for a device that is not the host, on a machine without a GPU.

The step runs on fake tensors (``FakeTensorMode``: shapes, dtypes and devices, no data)
over a process group on torch's ``fake`` backend (every collective accepted, nothing
moved), as ``shardfn.explain`` plans. The device is torch's Python-backed PrivateUse1
device, renamed ``gpu``, not a fake ``cuda``: on a CPU-only build autograd asks CUDA's
device guard for every fake CUDA leaf (``torch::autograd::InputMetadata``), which fails
with "PyTorch is not linked with support for cuda devices". What the proof needs of the
device is only that it is not the host, which ``gpu`` is as CUDA is.

Run as a script, it records the configurations given as JSON on the command line, each in
this process one after the other, and prints one JSON line per configuration.
"""

import functools
import json
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

DEVICE = "gpu"


class FakeDeviceMode(FakeTensorMode):
    """Fake tensors on a device that cannot compute: no constant is folded by running it there."""

    avoid_device_init = True


@functools.cache
def install() -> None:
    from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

    class Module(_DummyBackendModule):  # remat saves and restores the device's generator
        def get_rng_state(self, device=None):
            return torch.zeros(16, dtype=torch.uint8)

        def set_rng_state(self, state, device=None):
            pass

    _setup_privateuseone_for_python_backend(DEVICE, backend_module=Module())


def _optimizer(name: str):
    import shardfn as sf

    return {
        "adamw_schedule": lambda: sf.optim.adamw(lambda c: 1e-3 * 0.9**c, weight_decay=0.1),
        "sgd": lambda: sf.optim.sgd(0.05, momentum=0.9),
        "muon": lambda: sf.optim.partition({"muon": sf.optim.muon(0.02), "adamw": sf.optim.adamw(1e-3)},
                                           lambda name, shape: "muon" if len(shape) >= 2 else "adamw"),
    }[name]()


def _plan(strategy: str, options: list[str]):
    import shardfn as sf

    kw = {}
    if "remat" in options:
        kw["remat"] = sf.Remat()
    if "bf16" in options:
        kw["precision"] = sf.Precision(param=torch.bfloat16, reduce=torch.float32)
    if "buckets" in options:
        kw["bucket_bytes"] = 1 << 16
    return sf.Plan(strategy, **kw)


def _loss(apply, params, batch):
    from shardfn.testing.models import lm_loss

    return lm_loss(apply(params, batch["x"]), batch["y"])


def _summary(gm: torch.fx.GraphModule, device: torch.device, axes: dict[str, str]) -> dict:
    host, reads, collectives = [], [], []
    for node in gm.graph.nodes:
        value = getattr(gm, node.target) if node.op == "get_attr" else node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) and v.device != device for v in values):
            host.append(f"{node.op} {node.target}")
        if node.op != "call_function":
            continue
        tags = getattr(node.target, "tags", ())
        if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
            reads.append(str(node.target))
        if getattr(node.target, "namespace", "") == "_c10d_functional" and "wait" not in str(node.target):
            arg = node.args[0].meta["val"]
            arg = arg[0] if isinstance(arg, (list, tuple)) else arg
            collectives.append([str(node.target), [axes.get(a, a) for a in node.args[1:] if isinstance(a, (str, int))],
                                list(arg.shape), str(arg.dtype), arg.numel() * arg.element_size()])
    return {"host": host, "host_reads": reads, "collectives": collectives}


def on_device(mesh, device: str):
    """``mesh`` (over a fake-backend group), said to be on ``device`` (``DEVICE`` or "cpu")."""
    import os

    install()
    os.environ["SHARDFN_CUDA_GRAPH"] = "1"  # what a device program is refused without: it is what is tested
    on = torch.device(device, 0) if device != "cpu" else torch.device("cpu")
    object.__setattr__(mesh, "_device", on)  # a fake-backend mesh would be on the host
    return mesh


def record_on(mesh, model, plan, optimizer, batch: dict, **step_options):
    """The program ``jit_step(graph="eager")`` records for ``model`` on ``mesh`` (made by
    :func:`on_device`), on fake tensors: its GraphModule."""
    import shardfn as sf

    params, _ = sf.functionalize(model)
    on = mesh.device
    with FakeDeviceMode(allow_non_fake_inputs=True):
        fake = sf.Params({n: torch.empty(p.shape, dtype=p.dtype, device=on).requires_grad_(p.requires_grad)
                          for n, p in params.items()})
        fake.module = params.module
        sharded = sf.shard(fake, mesh, plan)
        state = optimizer.init(sharded)
        step = sf.jit_step(_loss, mesh, optimizer=optimizer, graph="eager", **step_options)
        batch = {k: torch.empty(v.shape, dtype=v.dtype, device=on) for k, v in batch.items()}
        for _ in range(2):  # the first call runs eagerly; the second records
            sharded, state, _ = step(sharded, state, batch)
        return next(iter(step.programs.values())).gm


def to_host(gm: torch.fx.GraphModule, groups: dict[str, str]) -> torch.fx.GraphModule:
    """``gm`` made to run on the host: every device argument that is ``DEVICE`` becomes the
    CPU, and each process group name in ``groups`` its replacement; one pass over the graph."""
    import torch.utils._pytree as pytree

    def host(a):
        if isinstance(a, torch.device) and a.type == DEVICE:
            return torch.device("cpu")
        return groups.get(a, a) if isinstance(a, str) else a

    for node in gm.graph.nodes:
        node.args = pytree.tree_map(host, node.args)
        node.kwargs = pytree.tree_map(host, node.kwargs)
    gm.recompile()
    return gm


def record(world: int, rank: int, strategy: str, optimizer: str, options: list[str], device: str,
           replicate: int | None = None) -> dict:
    """The program recorded on rank ``rank`` of a fake world, on ``device`` (``DEVICE`` or
    "cpu"), summarised: its host tensors, host reads, and its collectives in order (kind,
    axis, shape, dtype, bytes); or the error that refused it."""
    import shardfn as sf
    from shardfn.testing.models import GPT, GPTConfig

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = on_device(sf.Mesh.from_group(replicate=replicate), device)
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2))
        batch = {"x": torch.zeros(2, 8, dtype=torch.long), "y": torch.zeros(2, 8, dtype=torch.long)}
        try:
            gm = record_on(mesh, model, _plan(strategy, options), _optimizer(optimizer), batch)
        except Exception as e:  # noqa: BLE001 (reported to the test)
            return {"error": f"{type(e).__name__}: {e}"}
        axes = {mesh.channel(a).group.group_name: a for a in mesh.axis_names}
        return _summary(gm, mesh.device, axes)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import os

    os.environ["SHARDFN_CUDA_GRAPH"] = "1"
    torch.set_num_threads(1)
    for config in json.loads(sys.argv[1]):
        print(json.dumps(record(**config)), flush=True)
