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

import contextlib
import os
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from .._io.checkpoint import load
from .._run.grad import jit_grad
from ._keywords import CANNOT, STATE_DICT_TYPES, plan_of, refuse, replicas_of, timeout_of
from ._shards import Shards, _on_meta

__all__ = ["TrainerStrategy"]

_WHO = "TrainerStrategy"
_nothing = contextlib.nullcontext
# [Note: Lightning checkpoints of shards]
# state_dict_type="sharded" writes a directory: shardfn.checkpoint's files (each rank its shards,
# the optimizers' state as one tree per kind, by leaf name: they load at any world size and
# strategy), and Lightning's own part (loops, callbacks, schedulers, the optimizers' kinds) in
# lightning.pt. A file is a full checkpoint, a directory a sharded one, whichever type saves next.
_REST, _KINDS, _DIRECTORY = "lightning.pt", "shardfn_optimizer_kinds", "shardfn_directory"


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
        ignored_modules, ignored_states: modules and parameters of the module kept outside
            the plan, whole on every rank (``shard(ignored=)``); their gradients are averaged
            over the ranks, so they train as under DDP.
        param_init_fn: for a module built under ``trainer.init_module(empty_init=True)``
            (deferred init): called on each module after its ``reset_parameters()``, unit by
            unit on the shards (``shard(init_fn=)``); for modules that initialise nothing
            themselves (``nn.MultiheadAttention``'s ``_reset_parameters``).
    """

    strategy_name = "shardfn"

    def __init__(self, sharding_strategy: Any = "FULL_SHARD", *, auto_wrap_policy: Any = None,
                 activation_checkpointing_policy: Any = None, cpu_offload: Any = None, state_dict_type: str = "full",
                 timeout: Any = timedelta(minutes=30), device_mesh: Any = None, plan: Any = None, units: Any = None,
                 param_init_fn: Any = None, ignored_modules: Any = None, ignored_states: Any = None,
                 accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: str | None = None,
                 start_method: str = "popen", **kwargs: Any) -> None:
        refuse(_WHO, kwargs, CANNOT)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"{_WHO}(state_dict_type={state_dict_type!r}): expected 'full' or 'sharded'.")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout_of(_WHO, timeout), start_method=start_method)
        self.plan = plan_of(_WHO, sharding_strategy, auto_wrap_policy, activation_checkpointing_policy, cpu_offload,
                            plan, units)
        self.state_dict_type = state_dict_type
        self._device_mesh = device_mesh
        self._init_fn = param_init_fn
        self._ignored = [*(ignored_modules or ()), *(ignored_states or ())]
        self.shards: Shards | None = None  # the module's state on the shards, once set up
        self._given_back = False
        self._grad_fn: Any = None
        self._grads: Any = None  # the last training_step's gradient shards, until backward takes them
        self._out: Any = None

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
        # the module's state out of it, sharded ([Note: Lightning's calls on shards]); again after
        # a teardown gave the module its state back
        self.shards = Shards(module, self.plan, replicas_of(_WHO, self.plan, self._device_mesh, self.num_nodes), _WHO,
                             self._init_fn, self._ignored)
        self._given_back = False
        self._grad_fn = jit_grad(self._loss, self.shards.mesh)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for opt in self.optimizers:
                self.shards.to_shards(opt)
        self.setup_precision_plugin()
        # (gradient_clip_val by norm: the norm of the whole gradient)
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.shards.clip_norm(clip_val)

    def _setup_model(self, model: Any) -> Any:
        return model  # (no DDP wrapper: the module stays itself, its state on the shards)

    @property
    def sharded(self) -> Any:
        """The module's state on this rank (a :class:`shardfn.ShardedParams`), once set up."""
        return None if self.shards is None else self.shards.sharded

    @property
    def mesh(self) -> Any:
        return None if self.shards is None else self.shards.mesh

    @property
    def _whole(self) -> bool:
        """Whether the LightningModule holds its state (before setup, after teardown)."""
        return self.shards is None or self._given_back

    def model_to_device(self) -> None:
        if self._whole and not _on_meta(self.model):  # (a meta module is initialised on the shards)
            super().model_to_device()

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``trainer.init_module(empty_init=True)``: the module is built on the meta device and
        each unit initialised on the shards by its ``reset_parameters()`` (Lightning's
        FSDPStrategy's deferred init), from the seed ``seed_everything`` set."""
        with super().tensor_init_context(empty_init=False), torch.device("meta") if empty_init else _nothing():
            yield

    def teardown(self) -> None:
        """The trained state back in the LightningModule, whole (every rank gathers it), as
        after DDP. The shards stay with the optimizers, for ``trainer.save_checkpoint`` after
        ``fit``; the next setup shards the module again."""
        module = self.lightning_module
        if not self._whole and module is not None:
            self.shards.give_back()
            self._given_back = True
        if module is None or not _on_meta(module):
            super().teardown()
            return
        module.cpu = lambda: module  # (a deferred init that failed: its meta tensors have nowhere to move)
        try:
            super().teardown()
        finally:
            del module.cpu

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
        self.shards.add_grads(grads, 1.0 / self.lightning_module.trainer.accumulate_grad_batches)
        return closure_loss

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
            return self.shards.apply.method(method)(self.sharded, *args, **kwargs)

    # -- state ([Note: Lightning checkpoints of shards]) ----------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # (into the shards: a full checkpoint is cut, a sharded one read by each rank)

    @property
    def _sharded_files(self) -> bool:
        return self.state_dict_type == "sharded" and not self._whole

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's ``state_dict`` (every rank gathers; rank 0 keeps it); with
        ``state_dict_type="sharded"`` nothing: :meth:`save_checkpoint` writes the shards."""
        if self._sharded_files:
            return {}
        return self.lightning_module.state_dict() if self._whole else self.shards.state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state with each shard-shaped tensor gathered whole (rank 0 keeps it)."""
        if self._sharded_files:
            return {}
        return self.shards.optimizer_state(getattr(optimizer, "_optimizer", optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """``"full"``: one file (rank 0 writes it). ``"sharded"``: a directory, the shards and
        the optimizers' state written by every rank (:func:`shardfn.checkpoint.save`), and the
        rest of Lightning's checkpoint (loops, callbacks, schedulers) in ``lightning.pt``."""
        if not self._sharded_files:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        rest[_KINDS] = self.shards.save(filepath, {i: getattr(o, "_optimizer", o) for i, o in enumerate(self.optimizers)})
        if self.is_global_zero:
            torch.save(rest, os.path.join(filepath, _REST))
        self.barrier("shardfn: the checkpoint is written")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        if not os.path.isdir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        rest = torch.load(os.path.join(checkpoint_path, _REST), weights_only=False)
        # (Lightning looks for these keys; the directory's files hold their values)
        return {**rest, "state_dict": {}, "optimizer_states": [{} for _ in rest[_KINDS]],
                _DIRECTORY: os.fspath(checkpoint_path)}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if _DIRECTORY in checkpoint:
            load(checkpoint[_DIRECTORY], self.sharded)  # (the optimizers' state: load_optimizer_state_dict)
        elif self._whole:  # (before setup: the module holds its state)
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            self.shards.load_state_dict(checkpoint["state_dict"])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if _DIRECTORY in checkpoint:
            self.shards.load(checkpoint[_DIRECTORY], dict(enumerate(self.optimizers)), checkpoint[_KINDS])
            return
        for opt, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            self.shards.load_optimizer_state(opt, saved)
