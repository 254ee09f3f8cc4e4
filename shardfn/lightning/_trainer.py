"""``lightning.pytorch.Trainer(strategy=TrainerStrategy(...))``: an unmodified LightningModule
trained on shardfn's shards.

[Note: Lightning's calls on shards]
Lightning drives a step as separate calls: ``training_step``, ``backward``, gradient
clipping, ``optimizer.step``, ``zero_grad``. So the strategy takes the module's state
(shardfn._run.functionalize.take: the LightningModule stays the module Lightning calls, its
parameters meta tensors) and shards it; then each call does its part on the shards:
``training_step`` runs :func:`shardfn.jit_grad` with the module's own ``training_step`` as the
loss (units gathered just in time, gradients reduced to shards: jit_step's code and its
guarantees: exact, or the same error on every rank before anything changes); ``backward``
adds that gradient, divided as Lightning divides the loss for accumulation, to each shard's
``.grad``; the user's torch optimizer, its parameters swapped for the shards, steps them in
place (an elementwise one only, as ``from_torch``: on a cut parameter another would compute
something else); clipping by norm takes the norm of the whole gradient, summed over the shards.
The optimizer and its LR scheduler stay the user's objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from .._mesh import Mesh
from .._run.functionalize import take
from .._run.grad import jit_grad
from .._shard import shard
from .._state.sharded import gather
from ..optim._gradients import global_norm
from ..optim._psum import on_shards
from ..optim._torch import ELEMENTWISE
from ..optim._whole import require_whole
from ._keywords import CANNOT, STATE_DICT_TYPES, plan_of, refuse, replicas_of, timeout_of

__all__ = ["TrainerStrategy"]

_WHO = "TrainerStrategy"


class TrainerStrategy(DDPStrategy):
    """shardfn's sharding for ``Trainer(strategy=...)``, with the keywords of Lightning's
    ``FSDPStrategy`` (docs/lightning.md says what each becomes).

    Args:
        sharding_strategy: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``,
            ``"HYBRID_SHARD"``, ``"_HYBRID_SHARD_ZERO2"`` (torch's names or its enum), or
            shardfn's ``"SHARD_OPTIMIZER"``.
        auto_wrap_policy: the layer classes that become units (a set, torch's
            ``ModuleWrapPolicy``, ``transformer_auto_wrap_policy`` or
            ``size_based_auto_wrap_policy`` as a partial); or ``units=``, a shardfn unit policy.
        activation_checkpointing_policy: the layer classes recomputed in backward.
        cpu_offload: the shards and the optimizer's state in host memory.
        state_dict_type: ``"full"`` (one file, the full model's ``state_dict``) or ``"sharded"``.
        timeout: the process group's timeout.
        device_mesh: ``(replicas, shards)`` for a hybrid strategy (default: one replica per node).
        plan: a whole :class:`shardfn.Plan` instead of the keywords above.
    """

    strategy_name = "shardfn"

    def __init__(self, sharding_strategy: Any = "FULL_SHARD", *, auto_wrap_policy: Any = None,
                 activation_checkpointing_policy: Any = None, cpu_offload: Any = None, state_dict_type: str = "full",
                 timeout: Any = timedelta(minutes=30), device_mesh: Any = None, plan: Any = None, units: Any = None,
                 accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: str | None = None,
                 start_method: str = "popen", **kwargs: Any) -> None:
        refuse(_WHO, kwargs, CANNOT)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"{_WHO}(state_dict_type={state_dict_type!r}): expected 'full' or 'sharded'.")
        if state_dict_type == "sharded":
            raise ValueError(f"{_WHO}(state_dict_type='sharded'): not yet; use 'full' (one file, the full model).")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout_of(_WHO, timeout), start_method=start_method)
        self.plan = plan_of(_WHO, sharding_strategy, auto_wrap_policy, activation_checkpointing_policy, cpu_offload,
                            plan, units)
        self.state_dict_type = state_dict_type
        self._device_mesh = device_mesh
        self.sharded: Any = None  # the module's state on this rank (shardfn.ShardedParams), once set up
        self.mesh: Mesh | None = None
        self._given_back = False
        self._grad_fn: Any = None
        self._grads: Any = None  # the last training_step's gradient shards, until backward takes them
        self._out: Any = None
        self._shards: dict[int, torch.Tensor] = {}  # id(the module's meta parameter) -> its shard
        self._names_of: dict[int, str] = {}  # id(the module's meta parameter) -> its name

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("shardfn", cls, description="shardfn's sharding of the LightningModule")

    # -- setup ---------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError(f"{_WHO}: {type(module).__name__} sets automatic_optimization = False. Manual "
                             "optimisation calls backward and the optimizer itself, in between which shardfn cannot "
                             "keep its shards' guarantees; use automatic optimisation (training_step returns the loss).")
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._take(module)  # (again after a teardown gave the module its state back)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._to_shards()
        self.setup_precision_plugin()
        self.precision_plugin.clip_grad_by_norm = self._clip_by_norm  # (the norm of the whole gradient)

    def _setup_model(self, model: Any) -> Any:
        return model  # (no DDP wrapper: the module stays itself, its state on the shards)

    def _take(self, module: Any) -> None:
        """The module's state out of it, sharded ([Note: Lightning's calls on shards])."""
        params, apply = take(module)
        self._given_back = False
        replicate = replicas_of(_WHO, self.plan, self._device_mesh, self.num_nodes)
        self.mesh = Mesh.from_group(replicate=replicate)
        self.sharded = shard(params, self.mesh, self.plan)
        del params
        self._apply = apply
        self._grad_fn = jit_grad(self._loss, self.mesh)
        self._names_of = {id(p): n for n, p in module.named_parameters()}
        self._shards = {i: self.sharded[n] for i, n in self._names_of.items()}

    def _to_shards(self) -> None:
        """Each optimizer's parameters: the shards of the module's (meta) parameters it was built on."""
        for opt in self.optimizers:
            if type(opt) not in ELEMENTWISE:  # (whole parameters on every rank, or one rank each: it may run)
                names = [self._names_of[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in self._names_of]
                require_whole(self.sharded, names, f"{_WHO} with torch.optim.{type(opt).__name__}",
                              "it is not known to be elementwise, as SGD, Adam and AdamW are: it may read the "
                              "whole parameter, and on this rank's shard would compute something else")
            for group in opt.param_groups:
                missing = [p for p in group["params"] if id(p) not in self._shards]
                if missing:
                    raise ValueError(f"{_WHO}: an optimizer holds {len(missing)} parameter(s) that are not the "
                                     "LightningModule's; build it in configure_optimizers from self.parameters().")
                group["params"] = [self._shards[id(p)] for p in group["params"]]

    def model_to_device(self) -> None:
        if self._whole:
            super().model_to_device()

    @property
    def _whole(self) -> bool:
        """Whether the LightningModule holds its state (before setup, after teardown)."""
        return self.sharded is None or self._given_back

    def teardown(self) -> None:
        """The trained state back in the LightningModule, whole (every rank gathers it), as
        after DDP. The shards stay with the optimizers, for ``trainer.save_checkpoint`` after
        ``fit``; the next setup shards the module again."""
        if not self._whole and self.lightning_module is not None:
            # (the non-persistent buffers too, which a state_dict leaves out)
            _give_back(self.lightning_module, {**self.sharded.buffers(), **gather(self.sharded)})
            self._given_back = True
        super().teardown()

    # -- evaluation ----------------------------------------------------------------------

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _run(self, method: str, context: Any, args: tuple, kwargs: dict) -> Any:
        """The module's ``method`` on the shards: a sharded call (units gathered as it runs)."""
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with context():
            return self._apply.method(method)(self.sharded, *args, **kwargs)

    # -- a step --------------------------------------------------------------------------

    def _loss(self, apply: Any, params: Any, batch: Any) -> torch.Tensor:
        args, kwargs = batch
        out = apply.method("training_step")(params, *args, **kwargs)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"{_WHO}: training_step returned {type(out).__name__}; under shardfn every rank "
                             "returns its loss at every step (a tensor, or a dict with 'loss').")
        self._out = out
        return loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.train_step_context():
            _, grads, _ = self._grad_fn(self.sharded, (args, kwargs))
        self._grads = grads
        out, self._out = self._out, None
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
        return {k: detach(v) for k, v in out.items()} if isinstance(out, Mapping) else out.detach()

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The last training_step's gradient, scaled as Lightning scaled its loss (``1 /
        accumulate_grad_batches``), added to each shard's ``.grad``."""
        grads, self._grads = self._grads, None
        if grads is None:
            raise RuntimeError(f"{_WHO}: backward without a training_step before it.")
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        for name, g in grads.items():
            p = self.sharded[name]
            g = g.to(p.dtype) * scale
            p.grad = g if p.grad is None else p.grad + g
        return closure_loss

    def _clip_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """``gradient_clip_val`` by norm: every shard's ``.grad`` scaled by one factor, from
        the norm of the whole gradient (each element counted once over the ranks)."""
        grads = {n: t.grad for n, t in self.sharded.items() if t.grad is not None}
        total = self._norm(grads)
        factor = min(1.0, float(clip_val) / (total + 1e-6))
        if factor < 1.0:
            for g in grads.values():
                g.mul_(factor)

    def _norm(self, grads: Mapping[str, torch.Tensor]) -> float:
        with on_shards(self.sharded):  # (each rank's shards: their sums of squares summed over the ranks)
            return float(global_norm(grads))

    # -- state ---------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's ``state_dict`` (every rank gathers; rank 0 keeps it)."""
        if self._whole:
            return self.lightning_module.state_dict()
        return gather(self.sharded, rank0_only=True)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        full = checkpoint["state_dict"]
        if self._whole:  # (before setup: the module holds its state)
            self.lightning_module.load_state_dict(full, strict=strict)
            return
        layout, rank = self.sharded.layout, self.sharded.layout.shard_rank(self.mesh)
        with torch.no_grad():
            for n, t in self.sharded.items():
                if n in layout.leaves:
                    t.copy_(layout.local_shard(n, full[n], rank, t.device))
                else:
                    t.copy_(full[n])
        self.sharded._values_replaced()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state with each shard-shaped tensor gathered whole (rank 0 keeps it)."""
        state = optimizer.state_dict()
        names = self._names(optimizer)
        kinds = sorted({k for s in state["state"].values() for k, v in s.items()
                        if isinstance(v, torch.Tensor) and v.dim() > 0})
        full: dict[str, dict[str, torch.Tensor]] = {}
        for kind in kinds:  # (a parameter not stepped yet has none: zeros gathered in its place)
            values = {names[i]: s[kind] for i, s in state["state"].items() if kind in s}
            values = {n: values.get(n, torch.zeros_like(self.sharded[n])) for n in names.values()}
            full[kind] = gather(self.sharded.replace(values), rank0_only=True)
        out = {"state": {}, "param_groups": state["param_groups"]}
        for i, s in state["state"].items():
            out["state"][i] = {k: (full[k].get(names[i]) if k in full else v) for k, v in s.items()}
        return out if self.is_global_zero else {}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        layout, rank = self.sharded.layout, self.sharded.layout.shard_rank(self.mesh)
        for opt, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            names = self._names(opt)
            state = {i: {k: (layout.local_shard(names[i], v, rank, self.sharded[names[i]].device)
                             if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in s.items()}
                     for i, s in saved["state"].items()}
            opt.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

    def _names(self, optimizer: Any) -> dict[int, str]:
        """The optimizer's parameter index (its state_dict's keys) -> the leaf it steps."""
        by_id = {id(t): n for n, t in self.sharded.items()}
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        return {i: by_id[id(p)] for i, p in enumerate(flat)}


def _give_back(module: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """``module``'s meta parameters and buffers (shardfn._run.functionalize.take) replaced by
    ``full``'s values, a tie one tensor again."""
    made: dict[int, torch.Tensor] = {}
    names = {id(t): n for n, t in [*module.named_parameters(remove_duplicate=False),
                                   *module.named_buffers(remove_duplicate=False)] if n in full}
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is not None and id(p) in names:
                m._parameters[k] = made.setdefault(id(p), torch.nn.Parameter(full[names[id(p)]],
                                                                             requires_grad=p.requires_grad))
        for k, b in list(m._buffers.items()):
            if b is not None and id(b) in names:
                m._buffers[k] = made.setdefault(id(b), full[names[id(b)]])
    module.__dict__.pop("_shardfn_apply", None)
