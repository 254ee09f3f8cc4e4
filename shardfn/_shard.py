"""shard: a model's state tree as this rank's shards, from values, a deferred init or Hugging Face weights.

The entry point sits above the sharded tree (shardfn._state.sharded) and the readers of
pretrained weights (shardfn._io), which both use the tree.
"""

from __future__ import annotations

import hashlib
import os

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from ._deprecated import renamed
from ._state.agreement import verify_agreement, verify_same_values
from ._comm.guard import guarded
from ._state.resolve import layout_for, make_subgroups
from ._state.materialize import deferred_state, scattered_state
from ._mesh import Mesh
from ._state.offload import Offload, place_on_host
from ._state.plan import Placement, Plan, Strategy, make_plan
from ._state.precision import Precision
from ._io.pretrained import read_weights
from ._io.safetensors import Source
from ._parallel.tensor import local_state

from ._state.sharded import ShardedParams, unit_views

__all__ = ["shard"]


@renamed(strategy="plan")
def shard(
    params: Mapping[str, torch.Tensor],
    mesh: Mesh,
    plan: Plan | Strategy | str = "FULL_SHARD",
    *,
    units: Any = None,
    precision: Precision | None = None,
    remat: Any = None,
    optional: Any = None,
    offload: Offload | None = None,
    reshard_after_forward: Any = None,
    placement: Placement | str | None = None,
    bucket_bytes: int | str | None = None,
    seed: int | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    src_rank: int | None = None,
    weights: str | os.PathLike | None = None,
    tensor_parallel: Mapping[str, Any] | str | None = None,
    ignored: Any = None,
) -> ShardedParams:
    """This rank's shards of ``params`` under ``plan`` on ``mesh``.

    Args:
        params: the model's state, name -> full tensor, as returned by
            :func:`shardfn.functionalize` (parameters and buffers; the module tree it
            carries lets ``units=by_module_type(...)`` resolve and tells buffers from
            parameters). Every rank passes the same values (same seed, or loaded weights).
        mesh: a :class:`shardfn.Mesh`.
        plan: a :class:`shardfn.Plan`, or a strategy (``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``,
            ``"NO_SHARD"``, ... or a :class:`shardfn.Strategy`). The keyword fields below
            are :class:`shardfn.Plan`'s, all eight: each one given replaces the plan's.
        units: which parameters travel together (one collective per unit and direction):
            a unit policy (``by_module_type(Block)``, ``by_param_count(n)``, ``by_prefix(...)``),
            module classes, or module paths. Default: each block of the model's outermost
            list of repeated blocks (``blocks.0``, ``blocks.1``, ...); the rest is the root unit.
        precision: a :class:`shardfn.Precision` (mixed precision); default: none.
        remat: a :class:`shardfn.Remat` (activation rematerialisation of units), or a
            unit policy as a shorthand for full remat of those units; default: none.
        optional: modules that some ranks may skip in a step (a vision encoder run only for
            batches with an image, experts chosen by the data), as a unit policy: each
            becomes a unit that every rank gathers when the step first calls ``apply``
            and keeps for the step, and reduces after the backward, with zero gradients
            where it did not run, so training is exact however the ranks use them. Costs
            their full parameters (and gradients) for the whole step.
        offload: ``shardfn.Offload(params=True, optimizer=True)``: this rank's parameter
            shards, their gradients and the optimizer state built from them live in host
            memory (pinned on CUDA); each unit is copied to the compute device just before
            its all-gather, gradient shards come back after their reduction, and the
            optimizer runs on the host. Buffers stay on the device. See [Note: offload].
        reshard_after_forward: whether each unit lets go of its gathered parameters after
            its forward (the strategy's rule by default): ``True``, ``False``, a sub-group
            size to keep them sharded within (ZeRO++'s hpZ), or a dict unit name -> one of those.
        placement: how each unit is cut into shards: ``"flat"`` (the default: the unit's
            parameters laid end to end and cut into equal pieces, so a shard of a parameter
            is a 1-D piece of it; all-gathers with no copy in or out) or ``"rows"`` (each
            parameter cut on dim 0, ``ceil(rows / world)`` rows per rank, zero-padded); see
            :class:`shardfn.Placement`.
        bucket_bytes: bytes of a collective's buffer that neighbouring units share
            ([Note: buckets]): their gradients reduce in one collective (DDP's buckets)
            and, under FULL_SHARD and SHARD_GRAD_OP, their parameters gather in one
            (default ``4 * 2**20``, or a size such as ``"4MiB"``; 0: every unit alone).
        seed: deferred init: ``params`` may be meta tensors (a model built under
            ``torch.device("meta")``); each unit is materialised in turn on every rank,
            initialised by ``reset_parameters()`` (and ``init_fn(module)``) from a seed
            derived from ``(seed, unit path)``, and only this rank's shard is kept; buffers
            are materialised the same way and kept whole. Equals
            :func:`shardfn.materialize` on one device, at every world size.
        init_fn: with ``seed``: called on each module after ``reset_parameters`` (for a
            Hugging Face model, ``model._init_weights``). Every parameter and
            floating-point buffer must be written by one of them (checked).
        src_rank: the real values live on this rank only (e.g. pretrained weights loaded
            there; other ranks may pass meta tensors): each unit is scattered from it and
            the buffers are broadcast from it.
        weights: a Hugging Face safetensors checkpoint (a directory written by
            ``save_pretrained``, with ``model.safetensors`` or a sharded set and its
            ``model.safetensors.index.json``, or one ``.safetensors`` file): each rank reads
            only the rows of its own shards, unit by unit, cast to the params' dtypes;
            ``params`` may be meta tensors. Keys are matched by the model's ``state_dict()``
            names (every missing, unexpected or mis-shaped key is named in one error);
            non-persistent buffers missing from the file keep their values, or, when meta,
            are initialised by ``reset_parameters()`` and ``init_fn`` (for a Hugging Face
            model ``init_fn=model._init_weights``). Needs ``safetensors``.
        tensor_parallel: on a mesh with a ``"tensor"`` axis (``Mesh.from_env(tensor=T)``), a
            mapping from module-path patterns (fnmatch: ``"blocks.*.mlp.0"``) to ``"colwise"``
            or ``"rowwise"``: those ``nn.Linear`` layers are split over the tensor axis, and
            each rank's pieces are sharded over ``shard`` as any leaf (docs/tensor-parallel.md).
            ``"colwise_gather_output"`` (a head: its output gathered), ``"embedding_rowwise"``
            (an ``nn.Embedding``'s vocabulary rows split);
            ``"sequence"``, ``"sequence_start"``, ``"sequence_end"``: sequence parallelism
            (norms run on each tensor rank's part of the sequence; [Note: the sequence
            region]). torch's ``ParallelStyle`` objects of those kinds are taken too.
            ``"auto"``: a transformers model's own plan (``model.config.base_model_tp_plan``).
        ignored: parameters kept outside the plan, as FSDP's ``ignored_modules`` /
            ``ignored_params``: module classes, module paths (every parameter under them) or
            parameter names. Each stays whole on every rank, in no unit: never gathered,
            never reduce-scattered, no flat buffer, no cast by ``precision``. Their gradients
            are averaged over the data ranks by one all-reduce per dtype after the backward
            (so the step stays equal to one process; FSDP leaves that to you), and the
            optimizer steps them whole ([Note: ignored parameters]). Freeze them to skip
            the all-reduce. Trainable ones in float32 only; not with a ``"tensor"`` axis,
            ``offload``, ``precision``, inside a remat unit, or under ``jit_step(graph=True)``.

    Returns:
        A :class:`ShardedParams` (the shards and the buffers); ``print(sharded.layout)``
        shows units and costs.

    Ranks check that they agree on the layout (one small all-gather) before anything else.

    Example:
        >>> params, apply = functionalize(model)
        >>> sharded = shard(params, mesh, "FULL_SHARD", units=by_module_type(Block))
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shard(): mesh must be a shardfn.Mesh (Mesh.from_env()), got {type(mesh).__name__}")
    with guarded(mesh):  # an argument refused on one rank reaches the others (at the layout agreement)
        plan = make_plan(plan, units=units, precision=precision, remat=remat, optional=optional, offload=offload,
                         reshard_after_forward=reshard_after_forward, placement=placement, bucket_bytes=bucket_bytes)
        return _shard(params, mesh, plan, seed, init_fn, src_rank, weights, tensor_parallel, ignored)


def _shard(params: Mapping[str, torch.Tensor], mesh: Mesh, plan: Plan, seed: int | None,
           init_fn: Callable[[nn.Module], None] | None, src_rank: int | None, weights: Any,
           tensor_parallel: Any = None, ignored: Any = None) -> ShardedParams:
    if not isinstance(params, Mapping) or isinstance(params, ShardedParams):
        raise TypeError(
            "shard(): params must be the mapping name -> tensor returned by functionalize(model)"
            + (" (these are already sharded; use gather() first to reshard)" if isinstance(params, ShardedParams) else "")
        )
    bad = [k for k, v in params.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"shard(): params[{bad[0]!r}] is a {type(params[bad[0]]).__name__}, not a tensor.")
    module: nn.Module | None = getattr(params, "module", None)
    layout = layout_for(params, module, mesh, plan, tensor_parallel, ignored)
    given = [k for k, v in (("seed", seed), ("src_rank", src_rank), ("weights", weights)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"shard(): pass one of seed= (deferred init), src_rank= (load from one rank) or weights= "
                         f"(a safetensors checkpoint), not {' and '.join(given)}.")
    source = Source(weights, "shard(weights=...)") if weights is not None else None
    meta = [n for n, t in params.items() if t.is_meta] if not given else []
    # Whether a rank passed meta tensors is part of what ranks must agree on, so that a
    # rank missing its weights makes every rank fail here instead of hanging later.
    meta_error = (
        f"shard(): {len(meta)} tensors of the state are on the meta device ({', '.join(meta[:4])}"
        f"{' ...' if len(meta) > 4 else ''}) on {mesh!r}. Pass seed=... to initialise them unit by unit "
        "(deferred init), or load real values on one rank and pass src_rank=that rank."
    )
    salt, hint = (1, meta_error) if meta else (0, "")
    if source is not None:  # every rank must read the same weights: their headers join the layout's fingerprint
        salt, hint = source.fingerprint() << 1, (
            f"shard(weights={source.path!r}) read {len(source.entries)} tensors here (names, shapes, dtypes and "
            f"first rows hash {salt >> 1:08x}); the weights count as part of the layout: ranks whose hash differs "
            "read other weights (another checkpoint, or a stale copy). Point every rank at the same checkpoint.")
    if seed is not None:  # ranks that draw their shards from different seeds would hold pieces of different models
        salt, hint = int.from_bytes(hashlib.blake2b(repr(seed).encode(), digest_size=7).digest(), "little") << 1, (
            f"shard(seed={seed!r}) here; the seed counts as part of the layout: ranks whose hash differs passed "
            "another seed. Pass the same seed on every rank.")
    verify_agreement(layout, mesh, salt=salt, hint=hint)
    make_subgroups(layout, mesh)
    if meta:
        raise ValueError(meta_error)
    if not given:
        verify_same_values(params, layout, mesh)  # (the full values, before each tensor rank takes its piece)
    if mesh.axis_size("tensor") > 1 and src_rank is None:  # (from src_rank each rank gets its block: _materialize)
        params = local_state(params, layout.splits, mesh.axis_size("tensor"), mesh.axis_rank("tensor"))
    rank = layout.shard_rank(mesh)
    with torch.no_grad():
        if seed is not None:
            data = deferred_state(module, layout, rank, mesh.device, seed, init_fn,
                                  (mesh.axis_size("tensor"), mesh.axis_rank("tensor")))
        elif src_rank is not None:
            data = scattered_state(params, layout, mesh, src_rank)
        elif source is not None:
            try:
                data = read_weights(source, layout, mesh, params, module, init_fn)
            finally:
                source.close()
        else:
            data = {n: layout.local_shard(n, params[n], rank, mesh.device) for n in layout.leaves}
            data.update({n: params[n].detach().to(mesh.device, copy=True) for n in (*layout.buffers, *layout.ignored)})
    if not layout.offloaded:  # offloaded shards are copied to the device in any case ([Note: offload])
        unit_views(data, layout, rank)
    if layout.offloaded:  # [Note: offload]: the shards in host memory, the buffers on the device
        data.update({n: place_on_host(data[n], mesh.device) for n in layout.leaves})
    for n, leaf in (*layout.leaves.items(), *layout.ignored.items()):
        data[n].requires_grad_(leaf.requires_grad)
    return ShardedParams({n: data[n] for n in (*layout.leaves, *layout.ignored, *layout.buffers)}, layout, mesh, module)
