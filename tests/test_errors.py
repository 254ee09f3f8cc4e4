"""Bad input fails fast with an error that names the leaf, the mesh and the fix."""

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.testing.models import GPT, GPTConfig, lm_loss


def _catch(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _gpt(n_layers=2):
    torch.manual_seed(0)
    return sf.functionalize(GPT(GPTConfig(vocab_size=17, seq_len=4, d_model=8, n_layers=n_layers, n_heads=2)))


def _batch(mesh):
    return {"x": torch.zeros(2, 4, dtype=torch.long), "y": torch.zeros(2, 4, dtype=torch.long)}


def single_rank_errors():
    mesh = sf.Mesh.from_group()
    out = {}
    params, apply = _gpt()
    x = torch.zeros(1, 4, dtype=torch.long)
    wrong = dict(params)
    wrong["blocks.9.extra"] = wrong.pop("blocks.1.ln1.weight")
    out["apply_plain"] = _catch(apply, wrong, x)
    out["unknown_strategy"] = _catch(sf.shard, params, mesh, "ZERO_SEVEN")
    out["container_unit"] = _catch(sf.shard, params, mesh, "FULL_SHARD", units=sf.by_prefix("blocks"))
    out["bad_prefix"] = _catch(sf.shard, params, mesh, "FULL_SHARD", units=sf.by_prefix("block.0"))
    out["policy_needs_module"] = _catch(sf.shard, dict(params), mesh, "FULL_SHARD", units=GPT)
    out["not_a_mesh"] = _catch(sf.shard, params, "cpu", "FULL_SHARD")
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    # Shards of a 3-layer model given to the apply of a 2-layer model.
    other_params, _ = _gpt(3)
    out["apply_other_model"] = _catch(apply, sf.shard(other_params, mesh, "FULL_SHARD"), x)
    opt = sf.optim.adamw(1e-3)
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b["x"]), b["y"]), mesh, optimizer=opt)
    state = opt.init(sharded)
    sharded, state, _ = step(sharded, state, _batch(mesh))
    # The same model sharded another way: a different layout.
    regrouped = sf.shard(params, mesh, "SHARD_GRAD_OP")
    out["other_layout"] = _catch(step, regrouped, opt.init(regrouped), _batch(mesh))
    # Optimizer state of another model.
    out["other_opt_state"] = _catch(step, sharded, opt.init(sf.shard(other_params, mesh, "FULL_SHARD")), _batch(mesh))
    out["plain_params_to_step"] = _catch(step, dict(params), state, _batch(mesh))
    out["loss_ignores_params"] = _catch(sf.jit_step(lambda apply, p, b: torch.ones(()), mesh, optimizer=opt), sharded, state, None)
    out["not_an_optimizer"] = _catch(sf.jit_step, lambda apply, p, b: 0, mesh, optimizer=torch.optim.SGD)
    return out


def test_single_rank_errors_name_leaf_and_fix(clusters):
    out = clusters[1].run(single_rank_errors)[0]
    assert "missing (1): blocks.1.ln1.weight" in out["apply_plain"] and "unexpected (1): blocks.9.extra" in out["apply_plain"]
    assert "'ZERO_SEVEN' is not one of" in out["unknown_strategy"] and "'SHARD_GRAD_OP'" in out["unknown_strategy"]
    assert "'blocks' is a ModuleList" in out["container_unit"] and "'blocks.0'" in out["container_unit"]
    assert "'block.0.'" in out["bad_prefix"]
    assert "needs the module tree" in out["policy_needs_module"] and "by_prefix" in out["policy_needs_module"]
    assert out["not_a_mesh"].startswith("TypeError") and "Mesh.from_env()" in out["not_a_mesh"]
    assert "unexpected (11): blocks.2.attn.proj.bias" in out["apply_other_model"]
    assert "missing" not in out["apply_other_model"]
    assert "different layout" in out["other_layout"] and "SHARD_GRAD_OP" in out["other_layout"]
    assert "opt.init(sharded)" in out["other_layout"]
    assert "opt_state.mu['blocks.2.attn.qkv.weight']" in out["other_opt_state"]
    assert "no parameter 'blocks.2.attn.qkv.weight'" in out["other_opt_state"]
    assert "expected the ShardedParams" in out["plain_params_to_step"]
    assert "does not depend on the parameters" in out["loss_ignores_params"]
    assert "init and update" in out["not_an_optimizer"]


def two_rank_errors():
    mesh = sf.Mesh.from_group()
    params, apply = _gpt()
    out = {}
    # Every rank builds both one-rank groups (new_group is collective), then uses its own.
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    small = sf.Mesh.from_group(solo)
    opt = sf.optim.sgd(0.1)
    sharded_small = sf.shard(params, small, "FULL_SHARD")
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b["x"]), b["y"]), mesh, optimizer=opt)
    out["mesh_size"] = _catch(step, sharded_small, opt.init(sharded_small), _batch(mesh))
    # Ranks that disagree about the plan: detected before any parameter collective.
    units = sf.by_prefix("blocks.0") if dist.get_rank() == 0 else sf.by_prefix("blocks.1")
    with sf.record_collectives() as log:
        out["disagree"] = _catch(sf.shard, params, mesh, "FULL_SHARD", units=units)
    out["disagree_collectives"] = [(c.purpose.value, c.unit) for c in log.calls]
    # The world is still usable afterwards: no rank is left inside a collective.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def test_two_rank_errors(clusters):
    for rank, out in enumerate(clusters[2].run(two_rank_errors)):
        assert "Mesh(shard=1" in out["mesh_size"] and "Mesh(shard=2" in out["mesh_size"]
        assert "same mesh" in out["mesh_size"]
        assert f"[rank {rank}]" in out["disagree"] and "ranks disagree about the layout" in out["disagree"]
        assert "ranks [1] differ" in out["disagree"]
        assert out["disagree_collectives"] == [("layout", "")]
        assert out["after"] == 2.0


def test_a_mesh_of_other_axes_is_refused_naming_the_ones_shardfn_uses():
    class FakeDM:
        ndim = 3
        shape = (2, 2, 2)
        mesh_dim_names = ("a", "b", "c")

    with pytest.raises(ValueError, match=r"3-D DeviceMesh \(2, 2, 2\) with axes \('a', 'b', 'c'\).*Mesh.from_env\(replicate=R, tensor=T\)"):
        sf.Mesh(FakeDM())  # type: ignore[arg-type]


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine where CUDA sees one GPU, as torchrun's workers see it; ``launch(rank, **env)``
    sets a worker's variables. Starting NCCL or picking a GPU fails the test: the error must
    come before both. ``started`` records the backend a process group would have started with."""
    started = []

    class Started(Exception):
        pass

    def refuse(*args, **kwargs):
        raise AssertionError(f"called with {args} {kwargs}: the error must come first")

    def record(backend, **kwargs):
        started.append(backend)
        raise Started(backend)  # stop here: no process group in the test process

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: refuse(backend) if backend == "nccl"
                        else record(backend, **kw))
    monkeypatch.setattr("sys.argv", ["examples/train_lm.py", "--steps", "50"])
    monkeypatch.delenv("SHARDFN_DEVICE", raising=False)

    def launch(rank, **env):
        for var in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29500")
        for var, value in {"RANK": str(rank), "LOCAL_RANK": str(rank), **env}.items():
            monkeypatch.setenv(var, value)

    launch.started, launch.Started = started, Started
    return launch


def test_more_processes_than_gpus_raise_one_clear_error_on_every_rank(one_gpu):
    # `torchrun --nproc-per-node 2 examples/train_lm.py` on one GPU: without the check, rank 1
    # dies in torch.cuda.set_device(1) ("invalid device ordinal") and rank 0 waits for it.
    texts = []
    for rank in (0, 1):
        one_gpu(rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="0")
        with pytest.raises(ValueError) as caught:
            sf.Mesh.from_env()
        texts.append(str(caught.value))
    assert texts[0] == texts[1]  # each rank decides from the same facts
    assert texts[0] == (
        "Mesh.from_env(): torchrun started 2 processes (LOCAL_WORLD_SIZE=2) on this machine, but CUDA sees 1 GPU "
        "(CUDA_VISIBLE_DEVICES=0); with NCCL each process needs a GPU of its own (it would fail at "
        "torch.cuda.set_device with 'invalid device ordinal'). Either:\n"
        "  * one process per GPU: `torchrun --nproc-per-node gpu examples/train_lm.py` (1 process here);\n"
        "  * a world of one, no torchrun: `python examples/train_lm.py`;\n"
        "  * gloo on the CPU, any number of processes: `SHARDFN_DEVICE=cpu torchrun --nproc-per-node N "
        "examples/train_lm.py`, or Mesh.from_env(device=\"cpu\") in the script.")
    # A launcher that sets no LOCAL_WORLD_SIZE: the rank whose LOCAL_RANK names no GPU says so.
    one_gpu(3, WORLD_SIZE="4")
    with pytest.raises(ValueError, match=r"this process is local rank 3 \(LOCAL_RANK=3\) on this machine, but CUDA "
                                         r"sees 1 GPU;"):
        sf.Mesh.from_env()
    # One process per GPU goes on to NCCL (refused here only because the test stops there).
    one_gpu(0, WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    with pytest.raises(AssertionError, match="the error must come first"):
        sf.Mesh.from_env()


@pytest.mark.parametrize("how", ["argument", "variable"])
def test_gloo_on_the_cpu_on_a_machine_with_a_gpu(one_gpu, monkeypatch, how):
    one_gpu(1, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    if how == "variable":
        monkeypatch.setenv("SHARDFN_DEVICE", "cpu")
    with pytest.raises(one_gpu.Started):
        sf.Mesh.from_env(device="cpu") if how == "argument" else sf.Mesh.from_env()
    assert one_gpu.started == ["gloo"]


def test_a_device_that_is_not_there_is_named(one_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "device is 'cuda' (NCCL, a GPU per process) or 'cpu' (gloo), got 'gpu'" in _catch(sf.Mesh.from_env,
                                                                                             device="gpu")
    assert "CUDA is not available here" in _catch(sf.Mesh.from_env, device="cuda")
    monkeypatch.setenv("SHARDFN_DEVICE", "cuda")
    assert "SHARDFN_DEVICE='cuda': CUDA is not available here" in _catch(sf.Mesh.from_env)
    assert "use SHARDFN_DEVICE=cpu, or unset it (gloo)" in _catch(sf.Mesh.from_env)


def hybrid_errors():
    params, _ = _gpt()
    flat = sf.Mesh.from_group()
    grid = sf.Mesh.from_group(replicate=2)
    return {
        "hybrid_on_1d": _catch(sf.shard, params, flat, "HYBRID_SHARD"),
        "full_on_2d": _catch(sf.shard, params, grid, "FULL_SHARD"),
        "bad_replicate": _catch(sf.Mesh.from_group, replicate=3),
        "grid": repr(grid),
    }


def test_hybrid_needs_a_two_dimensional_mesh(clusters):
    out = clusters[4].run(hybrid_errors)[0]
    assert "HYBRID_SHARD shards over the 'shard' axis" in out["hybrid_on_1d"] and "Mesh(shard=4" in out["hybrid_on_1d"]
    assert "replicate=R" in out["hybrid_on_1d"]
    assert "FULL_SHARD runs on a 1-D mesh" in out["full_on_2d"] and "Mesh(replicate=2, shard=2" in out["full_on_2d"]
    assert "replicate=3 must be a positive divisor of the world size 4" in out["bad_replicate"]
    assert out["grid"].startswith("Mesh(replicate=2, shard=2, device=cpu, backend=gloo, rank=")


def test_nccl_makes_its_communicator_when_the_mesh_is_made(one_gpu, monkeypatch):
    # device_id= makes NCCL's communicator at init_process_group, not at the first
    # collective, which a graph step may run inside a CUDA graph's capture.
    one_gpu(0, WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    made = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: made.append(("set_device", device)))

    def init(backend, **kwargs):
        made.append((backend, kwargs.get("device_id")))
        raise one_gpu.Started(backend)

    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(one_gpu.Started):
        sf.Mesh.from_env()
    assert made == [("set_device", torch.device("cuda", 0)), ("nccl", torch.device("cuda", 0))]
