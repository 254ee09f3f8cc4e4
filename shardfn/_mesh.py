"""Mesh: a thin, immutable view over ``torch.distributed.device_mesh.DeviceMesh``."""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._comm import collectives as C
from ._comm import guard as _guard
from ._parallel.rng import TensorRandom
from ._comm.events import Purpose

__all__ = ["Mesh"]

DEFAULT_TIMEOUT = 600.0  # seconds: the process group's own timeout

_AXES = ((1, ("shard",)), (1, ()), (2, ("replicate", "shard")), (2, ("shard", "tensor")),
         (3, ("replicate", "shard", "tensor")))


def seconds(value: float | datetime.timedelta, what: str) -> float:
    """A timeout in seconds, from a positive number of seconds or a ``timedelta``."""
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what}: a timeout is a positive number of seconds or a datetime.timedelta, got {value!r}.")
    return float(value)

_NO_ENV = (
    "Mesh.from_env(): the default process group is not initialised and torchrun's variables "
    "{missing} are not set. Launch with `torchrun --nproc-per-node N script.py`, or call "
    "torch.distributed.init_process_group(...) first, or build a mesh with Mesh.from_group()."
)

# Where a process started under torchrun puts its shards when the script does not say
# (Mesh.from_env(device=...)): "cuda" or "cpu"; so a script runs on the CPU unchanged.
DEVICE_VARIABLE = "SHARDFN_DEVICE"

# The same text on every rank: each decides from the same facts (its machine's process count
# and devices), so every rank raises it before any of them waits for the others.
_TOO_FEW_GPUS = (
    "{what}: {started} on this machine, but CUDA sees {devices}{visible}; with NCCL each process needs a "
    "GPU of its own (it would fail at torch.cuda.set_device with 'invalid device ordinal'). Either:\n"
    "  * one process per GPU: `torchrun --nproc-per-node gpu {script}` ({count} here);\n"
    "  * a world of one, no torchrun: `python {script}`;\n"
    "  * gloo on the CPU, any number of processes: {cpu}."
)
_CPU_FROM_ENV = "`{variable}=cpu torchrun --nproc-per-node N {script}`, or Mesh.from_env(device=\"cpu\") in the script"


class Mesh:
    """The devices a sharded tree lives on.

    1-D, with the single axis ``"shard"``, for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD;
    2-D, with axes ``("replicate", "shard")``, for the hybrid strategies: parameters are
    sharded over ``shard`` (inside a node) and replicated over ``replicate`` (across
    nodes). Build it with :meth:`Mesh.from_env` (under ``torchrun``) or
    :meth:`Mesh.from_group`. Collectives for an axis run on ``mesh.group(axis)``.

    Example:
        >>> mesh = Mesh.from_env()                       # torchrun --nproc-per-node 2
        Mesh(shard=2, device=cpu, backend=gloo, rank=0)
        >>> mesh = Mesh.from_env(replicate="nodes")      # torchrun --nnodes 2 --nproc-per-node 4
        Mesh(replicate=2, shard=4, device=cpu, backend=gloo, rank=0)
    """

    __slots__ = ("_dm", "_device", "guard", "random", "_ranks")

    def __init__(self, device_mesh: DeviceMesh, step_timeout: float = _guard.DEFAULT_STEP_TIMEOUT):
        names = tuple(device_mesh.mesh_dim_names or ())
        if (device_mesh.ndim, names) not in _AXES:
            raise ValueError(
                f"Mesh: got a {device_mesh.ndim}-D DeviceMesh {tuple(device_mesh.shape)} with axes {names}; "
                "shardfn uses the axes ('shard',), ('replicate', 'shard'), ('shard', 'tensor') or "
                "('replicate', 'shard', 'tensor'). Build one with Mesh.from_env(replicate=R, tensor=T)."
            )
        self._dm = device_mesh
        self._ranks: dict[str, int] = {}  # axis -> this rank's index on it (fixed: asked per unit and step)
        if device_mesh.device_type == "cuda":
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device(device_mesh.device_type)
        # The schedule guard of this mesh's groups (see [Note: the guard's state]).
        self.guard = _guard.Guard(seconds(step_timeout, "Mesh(step_timeout=...)"))
        _add_channels(device_mesh, self.guard)
        # The tensor group's random stream (see [Note: randomness on the tensor axis]).
        self.random = TensorRandom()

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_env(cls, *, replicate: int | str | None = None, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
                 step_timeout: float | datetime.timedelta = _guard.DEFAULT_STEP_TIMEOUT,
                 device: str | None = None, tensor: int | None = None) -> "Mesh":
        """A mesh over the whole world.

        Initialises the default process group from torchrun's variables (``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when it is not initialised yet:
        NCCL on GPU ``LOCAL_RANK`` when CUDA is available, gloo on the CPU otherwise (or as
        ``device`` says); a process started without torchrun becomes a world of one. An
        existing default group is used as it is. With NCCL, every process raises the same
        ``ValueError`` before starting it when torchrun started more processes on the
        machine (``LOCAL_WORLD_SIZE``) than CUDA sees GPUs.

        Args:
            replicate: ``None`` for a 1-D mesh; an int ``R`` for a 2-D mesh of ``R``
                replicas of ``world / R`` shards (consecutive ranks share a replica);
                ``"nodes"`` for one replica per node (``R`` = torchrun's ``--nnodes``,
                read as ``WORLD_SIZE / LOCAL_WORLD_SIZE``), so ``shard`` runs within a node.
            timeout: the process group's timeout (torch's own limit on any collective), in
                seconds or a ``datetime.timedelta`` (as every timeout of the library). Default 600 s.
            step_timeout: seconds a rank waits for the others at any shardfn collective
                before every waiting rank raises :class:`shardfn.CommError` naming the
                ranks that did not come (stopped, dead, or busy elsewhere); see
                [Note: the schedule guard]. A rank that raises inside shardfn tells the
                others at once; this bounds only the silent cases. Default 60 s.
            device: ``"cuda"`` (NCCL, one GPU per process) or ``"cpu"`` (gloo, any number
                of processes, also on a machine with GPUs). ``None``: the environment
                variable ``SHARDFN_DEVICE`` if set (``SHARDFN_DEVICE=cpu torchrun ...``
                runs a script on the CPU unchanged), else ``"cuda"`` when CUDA is available.
            tensor: ``None``, or ``T`` for a ``"tensor"`` axis of ``T`` consecutive ranks (the
                innermost axis, inside a node) for tensor parallelism: axes ``("shard", "tensor")``,
                or ``("replicate", "shard", "tensor")`` with ``replicate``; see docs/tensor-parallel.md.

        Example:
            >>> mesh = Mesh.from_env(device="cpu")           # gloo, even on a machine with one GPU
        """
        device = _device(device)
        if not dist.is_initialized():
            _init_from_env(datetime.timedelta(seconds=seconds(timeout, "Mesh.from_env(timeout=...)")), device)
        elif device is not None and (dist.get_backend() == "nccl") != (device == "cuda"):
            raise ValueError(
                f"Mesh.from_env(device={device!r}): the default process group already runs {dist.get_backend()}; "
                f"a mesh on {device} needs {'nccl' if device == 'cuda' else 'gloo'}. Drop device= (and "
                f"{DEVICE_VARIABLE}) to use the group as it is, or start it with the other backend."
            )
        if replicate == "nodes":
            if "LOCAL_WORLD_SIZE" not in os.environ:
                raise ValueError(
                    "Mesh.from_env(replicate='nodes'): LOCAL_WORLD_SIZE is not set; launch with torchrun "
                    "(--nnodes N --nproc-per-node P) or pass replicate=N."
                )
            replicate = dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"])
        return cls.from_group(None, replicate=replicate, step_timeout=step_timeout, tensor=tensor)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, *, replicate: int | None = None,
                   step_timeout: float | datetime.timedelta = _guard.DEFAULT_STEP_TIMEOUT,
                   tensor: int | None = None) -> "Mesh":
        """A mesh over an existing process group (the default group when ``None``).

        With ``replicate=R`` (default group only) the mesh is 2-D: ``R`` replicas of
        ``world / R`` shards. With ``tensor=T`` (default group only) a ``"tensor"`` axis of
        ``T`` consecutive ranks is added innermost. ``step_timeout``: as for :meth:`from_env`.
        """
        if not dist.is_initialized():
            raise ValueError(_NO_ENV.format(missing="(any)"))
        group = group or dist.group.WORLD
        backend = dist.get_backend(group)
        device_type = "cuda" if backend == "nccl" else "cpu"
        if device_type == "cuda":
            _check_gpus("Mesh.from_group()", cpu='torch.distributed.init_process_group("gloo") in the script')
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        if tensor is not None:
            return cls._with_tensor(group, device_type, replicate, tensor, step_timeout)
        if replicate is not None:
            world = dist.get_world_size()
            if group is not dist.group.WORLD:
                raise ValueError("Mesh.from_group(group, replicate=R): a 2-D mesh is built over the default group only.")
            if not isinstance(replicate, int) or replicate < 1 or world % replicate:
                raise ValueError(
                    f"Mesh: replicate={replicate!r} must be a positive divisor of the world size {world} "
                    f"(R replicas of world/R shards); for example replicate={_divisors(world)}."
                )
            return cls(init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")),
                       step_timeout)
        if group is dist.group.WORLD:
            dm = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",))
        else:
            dm = DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))
        return cls(dm, step_timeout)

    @classmethod
    def _with_tensor(cls, group: dist.ProcessGroup, device_type: str, replicate: int | None, tensor: int,
                     step_timeout: Any) -> "Mesh":
        """``from_group(tensor=T)``: axes ("shard", "tensor") or ("replicate", "shard", "tensor")."""
        world = dist.get_world_size()
        if group is not dist.group.WORLD:
            raise ValueError("Mesh.from_group(group, tensor=T): a mesh with a tensor axis is built over the default "
                             "group only.")
        if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1 or world % tensor:
            raise ValueError(f"Mesh: tensor={tensor!r} must be a positive divisor of the world size {world} "
                             f"(T consecutive ranks split each layer); for example tensor={_divisors(world)}.")
        rest = world // tensor
        if replicate is None:
            return cls(init_device_mesh(device_type, (rest, tensor), mesh_dim_names=("shard", "tensor")), step_timeout)
        if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1 or rest % replicate:
            raise ValueError(f"Mesh: replicate={replicate!r} must be a positive divisor of world / tensor = {rest}; "
                             f"for example replicate={_divisors(rest)}.")
        return cls(init_device_mesh(device_type, (replicate, rest // replicate, tensor),
                                    mesh_dim_names=("replicate", "shard", "tensor")), step_timeout)

    # -- properties --------------------------------------------------------------------

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._dm

    @property
    def device(self) -> torch.device:
        """Where shards and gathered parameters live (``cuda:<local rank>`` or ``cpu``)."""
        return self._device

    @property
    def step_timeout(self) -> float:
        """Seconds a rank waits for the others at a collective (see :meth:`from_env`)."""
        return self.guard.timeout

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._dm.mesh_dim_names or ("shard",))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._dm.shape)

    @property
    def ndim(self) -> int:
        return self._dm.ndim

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return self._dm.size()

    @property
    def data_size(self) -> int:
        """Ranks that see different batches: ``replicate x shard`` (the ranks of a ``tensor``
        axis see the same batch and split each layer between them)."""
        return self.size // self.axis_size("tensor")

    @property
    def data_rank(self) -> int:
        """This rank's index among the :attr:`data_size` ranks that see different batches."""
        return self.rank // self.axis_size("tensor")

    @property
    def rank(self) -> int:
        """This process's rank within the mesh (row-major over the axes)."""
        r = 0
        for axis in self.axis_names:
            r = r * self.axis_size(axis) + self.axis_rank(axis)
        return r

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group("shard")))

    @property
    def fake(self) -> bool:
        """Whether the mesh is over torch's ``fake`` process group: a planning run
        (``shardfn.explain``), whose tensors hold no values to read and whose collectives
        move none."""
        return self.guard.fake

    def group(self, axis: str) -> dist.ProcessGroup:
        if axis not in self.axis_names:
            raise ValueError(f"mesh.group({axis!r}): {self!r} has no axis {axis!r}; its axes are {self.axis_names}.")
        return self._dm.get_group(axis if self._dm.mesh_dim_names else 0)

    def channel(self, axis: str) -> _guard.Channel:
        """The group of ``axis`` as shardfn's collectives take it (with its schedule guard)."""
        if axis not in self.axis_names:
            self.group(axis)  # a clear error for an unknown axis
        return self.guard.channels[axis]

    def subgroup(self, size: int) -> tuple[_guard.Channel, int]:
        """The channel of this rank's block of ``size`` consecutive ranks along the
        ``shard`` axis, and this rank's index in it (a unit resharded to a sub-group after
        forward gathers there in backward: ``Plan(reshard_after_forward=size)``).

        Made on first use, by every rank (creating groups is collective), then kept by the mesh."""
        cached = self.guard.subgroups.get(size)
        if cached is None:
            i = self.axis_names.index("shard")
            with unset_fake_temporarily():  # explain plans under FakeTensorMode; the rank table is real
                rows = self._dm.mesh.movedim(i, -1).reshape(-1, self._dm.mesh.size(i)).tolist()
            blocks = [row[j : j + size] for row in rows for j in range(0, len(row), size)]
            group, _ = dist.new_subgroups_by_enumeration(blocks)
            control = None
            if self._dm.device_type == "cuda":  # the guard's headers go over gloo (see _add_channels)
                control, _ = dist.new_subgroups_by_enumeration(blocks, backend="gloo")
            cached = self.guard.subgroups[size] = (self.guard.channel(group, "shard", control),
                                                    self.axis_rank("shard") % size)
        return cached

    def axis_size(self, axis: str) -> int:
        if axis not in self.axis_names:
            return 1
        return self._dm.size(self.axis_names.index(axis))

    def axis_rank(self, axis: str) -> int:
        got = self._ranks.get(axis)
        if got is None:
            got = self._ranks[axis] = 0 if axis not in self.axis_names else int(
                self._dm.get_local_rank(axis if self._dm.mesh_dim_names else 0))
        return got

    # -- collectives for the training loop -------------------------------------------------
    # What Lightning's strategy.barrier / broadcast / reduce / all_gather do, over the whole
    # mesh, through shardfn._comm.collectives: recorded (purpose "user") and guarded like every
    # other collective, so a rank that is elsewhere is named instead of waited for.

    def barrier(self) -> None:
        """Returns once every rank of the mesh has called it."""
        C.barrier_mesh(self)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Mesh rank ``src``'s ``obj`` (any picklable value: a config, a list of file names,
        a tensor) on every rank; ``src`` returns its own ``obj``.

        Example:
            >>> files = mesh.broadcast(sorted(os.listdir(data_dir)) if mesh.rank == 0 else None)
        """
        if not (isinstance(src, int) and 0 <= src < self.size):
            raise ValueError(f"mesh.broadcast(obj, src={src!r}): src must be a mesh rank, 0 to {self.size - 1}.")
        if self.size == 1:
            return obj
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        C.broadcast_mesh(size, self, src, Purpose.USER)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8))
        buf = buf.to(self._device)
        C.broadcast_mesh(buf, self, src, Purpose.USER)
        return obj if self.rank == src else pickle.loads(buf.cpu().numpy().tobytes())

    def reduce(self, tensor: torch.Tensor, op: str | dist.ReduceOp = "mean") -> torch.Tensor:
        """A new tensor: ``tensor`` reduced over every rank of the mesh (``"mean"``,
        ``"sum"``, ``"max"`` or ``"min"``, in any case, or torch's ``ReduceOp.AVG``, ``SUM``,
        ``MAX``, ``MIN``), the same on every rank, on ``tensor``'s device. A mean of integers
        is a float tensor.

        Example:
            >>> val_loss = mesh.reduce(torch.tensor(local_loss))     # the mean over ranks
        """
        ops = {"mean": C.SUM, "sum": C.SUM, "max": C.MAX, "min": C.MIN}
        torch_ops = {dist.ReduceOp.AVG: "mean", dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max",
                     dist.ReduceOp.MIN: "min"}
        op = torch_ops.get(op, op) if not isinstance(op, str) else op.lower()
        if op not in ops:
            raise ValueError(f"mesh.reduce(tensor, op={op!r}): op must be one of {sorted(ops)}.")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"mesh.reduce(tensor, ...): expected a tensor, got {type(tensor).__name__}; "
                            "wrap numbers with torch.tensor(x).")
        out = tensor.detach().to(self._device, copy=True)
        if op == "mean" and not out.is_floating_point():
            out = out.double()
        if self.size > 1:
            C.all_reduce_mesh(out, self, Purpose.USER, op=ops[op])
        if op == "mean":
            out = out / self.size
        return out.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in mesh-rank order: ``[mesh.size, *tensor.shape]``,
        on ``tensor``'s device. Every rank must pass the same shape and dtype (else every
        rank raises, naming each rank's bytes)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"mesh.all_gather(tensor): expected a tensor, got {type(tensor).__name__}.")
        t = tensor.detach().contiguous().to(self._device)
        if self.size == 1:
            return t.unsqueeze(0).to(tensor.device, copy=True)
        shape = zlib.crc32(repr(tuple(tensor.shape)).encode()) & 0x7FFFFFFF  # same bytes, other shape: refused
        return C.all_gather_mesh(t, self, Purpose.USER, detail=shape).view(self.size, *tensor.shape).to(tensor.device)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"Mesh({axes}, device={self._device}, backend={self.backend}, rank={self.rank})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and other._dm == self._dm

    def __hash__(self) -> int:
        return hash(self._dm)

    def __copy__(self) -> "Mesh":
        return self  # a mesh names process groups and owns their guard: copies share them

    def __deepcopy__(self, memo: dict[int, Any]) -> "Mesh":
        return self


def _add_channels(dm: DeviceMesh, guard: _guard.Guard) -> None:
    """A channel for every axis group of ``dm`` (see [Note: the schedule guard]). The headers
    go over the group itself on CPU, and over a gloo group of the same ranks beside each
    NCCL group (a header read on the host must not wait for the GPU's stream)."""
    names = dm.mesh_dim_names or ("shard",)
    for i, axis in enumerate(names):
        group = dm.get_group(axis if dm.mesh_dim_names else 0)
        control = None
        if dm.device_type == "cuda" and dist.get_world_size(group) > 1:
            # Every rank creates every group of the axis (new_group is collective), in the same order.
            rows = dm.mesh.movedim(i, -1).reshape(-1, dm.mesh.size(i)).tolist()
            control, _ = dist.new_subgroups_by_enumeration(rows, backend="gloo")
        guard.channels[axis] = guard.channel(group, axis, control)
        guard.fake = str(dist.get_backend(group)) == "fake"


def _device(device: str | None) -> str | None:
    """``Mesh.from_env(device=...)``, else ``$SHARDFN_DEVICE``, checked: "cuda", "cpu" or None."""
    what, cpu = f"Mesh.from_env(device={device!r})", "device='cpu'"
    if device is None:
        device = os.environ.get(DEVICE_VARIABLE) or None
        what, cpu = f"Mesh.from_env(): {DEVICE_VARIABLE}={device!r}", f"{DEVICE_VARIABLE}=cpu, or unset it"
    if device is None:
        return None
    if str(device).lower() not in ("cuda", "cpu"):
        raise ValueError(f"{what}: the device is 'cuda' (NCCL, a GPU per process) or 'cpu' (gloo), got {device!r}.")
    device = str(device).lower()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what}: CUDA is not available here (torch {torch.__version__}, "
                         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use {cpu} (gloo).")
    return device


def _check_gpus(what: str, cpu: str = _CPU_FROM_ENV) -> None:
    """Raises the same clear error on every process of a machine that has more of them than
    CUDA sees GPUs (``LOCAL_WORLD_SIZE``), or whose ``LOCAL_RANK`` names no GPU, before
    ``torch.cuda.set_device`` fails with 'invalid device ordinal' (and before NCCL starts)."""
    count = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))  # torchrun sets it; other launchers may not
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world <= count and local_rank < count:
        return
    if local_world > count:
        started = f"torchrun started {local_world} processes (LOCAL_WORLD_SIZE={local_world})"
    else:  # no LOCAL_WORLD_SIZE, or fewer than LOCAL_RANK: only this fact differs between the processes
        started = f"this process is local rank {local_rank} (LOCAL_RANK={local_rank})"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "script.py"
    raise ValueError(_TOO_FEW_GPUS.format(
        what=what, started=started, devices=f"{count} GPU{'' if count == 1 else 's'}",
        visible=f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "", script=script,
        count=f"{count} process{'' if count == 1 else 'es'}", cpu=cpu.format(variable=DEVICE_VARIABLE, script=script)))


def _init_from_env(timeout: datetime.timedelta, device: str | None = None) -> None:
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        # Plain `python script.py`: a world of one, on a loopback store.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(_NO_ENV.format(missing=", ".join(missing)))
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if not use_cuda:
        dist.init_process_group("gloo", timeout=timeout)
        return
    _check_gpus("Mesh.from_env()")
    gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(gpu)
    # device_id: NCCL makes its communicator now, not at the first collective, which may
    # be inside a CUDA graph's capture (docs/compile.md, "The CUDA path")
    dist.init_process_group("nccl", timeout=timeout, device_id=gpu)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
