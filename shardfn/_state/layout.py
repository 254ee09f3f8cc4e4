"""Layout: static metadata of a sharded tree, identical on every rank.

[Note: dim-0 shards and unit buffers]
Every parameter is split on dim 0 into ``world`` chunks of ``chunk = ceil(rows / world)``
rows; the last ranks' chunks are zero-padded (a 0-d parameter counts as one row). A
unit's shards are laid end to end into one flat buffer of ``unit.numel`` elements per
rank, so one all-gather of that buffer yields a ``[world, unit.numel]`` tensor in which
leaf ``i`` occupies columns ``offset_i : offset_i + chunk_i * row_numel_i`` of every
row: rank ``r``'s chunk. Unpacking a leaf copies those columns out, rank after rank,
and drops the padding rows; packing a gradient for the reduce-scatter does the reverse.
A step does both for a whole unit in one copy (:func:`unpack_unit`, :func:`pack_unit`;
see [Note: copies] in _group/gather.py and _group/reduce.py); :func:`unpack_leaf` and :func:`pack_leaf` do one leaf.
Under NO_SHARD the "shard" is the whole parameter (``world`` is 1 for layout purposes)
and the unit buffer is what the all-reduce runs on.

[Note: placements]
What the note above describes is ``Placement.ROWS``. Under ``Placement.FLAT`` a unit's
parameters are laid end to end, in unit order, into one *global* flat buffer of
``world * unit.numel`` elements (padding at the end only), and rank ``r`` holds elements
``[r * numel, (r + 1) * numel)`` of it: its shard buffer. Leaf ``i`` occupies elements
``[start_i, start_i + numel_i)``; its shard on rank ``r`` is the (possibly empty) 1-D piece
where that range meets the rank's. So the all-gather's output, read flat, *is* the global
buffer: it takes this rank's shard buffer as it is (no pack when the shards are views of
it) and every full parameter is a view of it (no unpack). A gradient buffer is laid out
the same way, so the reduce-scatter's output is this rank's gradient shard buffer and each
leaf's shard gradient is a view of it (one copy per unit: autograd's per-parameter
gradients into the buffer). For a leaf's shard and its gradient to be the same elements,
a flat unit holds only trainable or only frozen parameters: a module with both is one
unit per (dtype, trainable) group, named ``path[float32,frozen]`` and the like.

Under ``whole(select)`` the parameters ``select`` picks form a unit of their own per module
(``path[whole]``), laid out in the same global buffer but each inside one rank's range:
the largest first, each to the rank whose range holds least so far, so ``unit.numel`` is
the largest rank's share and the others end in padding. The buffer then has gaps between
leaves; every packing below places each piece at its offset and zeros the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .bucketing import gather_buckets, reduce_buckets
from .._comm.guard import unit_id
from .packing import local_shard
from .plan import Placement, Plan, Reduction, RematMode, Strategy, Whole, whole_starts
from .._parallel.call import params_text, styles_text
from .tree import TreeInfo

__all__ = ["BufferLayout", "IgnoredLayout", "LeafLayout", "Layout", "UnitLayout", "unit_owner"]


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """One parameter: its global shape and where its shard sits in its unit's buffer."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    unit: int
    chunk: int  # rows per rank
    offset: int  # element offset of this leaf's shard in the unit's flat shard buffer
    grad_offset: int  # offset in the unit's flat *gradient* buffer (trainable leaves only); -1 if frozen
    start: int = -1  # Placement.FLAT: element offset in the unit's global flat buffer ([Note: placements]); else -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def flat(self) -> bool:
        return self.start >= 0

    def piece(self, rank: int, span: int) -> tuple[int, int]:
        """``(offset in rank's shard buffer, length)`` of this leaf's shard on ``rank``, in a
        unit whose shard buffers have ``span`` elements (``UnitLayout.numel``)."""
        if not self.flat:
            return self.offset, self.shard_numel
        lo, hi = max(self.start, rank * span), min(self.start + self.numel, (rank + 1) * span)
        return (lo - rank * span, hi - lo) if hi > lo else (0, 0)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Placement.ROWS: the shape of every rank's shard (a flat leaf's depends on the rank:
        :meth:`Layout.shard_shape`)."""
        return (self.chunk, *self.shape[1:]) if self.shape else (1,)

    @property
    def shard_numel(self) -> int:
        return self.chunk * self.row_numel

    def local_rows(self, rank: int) -> int:
        """How many real (non-padding) rows rank ``rank`` holds."""
        return max(0, min(self.chunk, self.rows - rank * self.chunk))


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """Parameters that travel together: one collective per direction."""

    index: int
    path: str  # module path; "" is the root unit (parameters outside every unit)
    leaves: tuple[str, ...]
    numel: int  # elements of the flat shard buffer per rank
    dtype: torch.dtype
    grad_numel: int  # elements of the flat gradient buffer per rank: trainable leaves only
    param_dtype: torch.dtype  # what the unit is gathered and computed in (see _precision)
    reduce_dtype: torch.dtype  # what its gradients are reduced in
    remat: RematMode | None = None  # see shardfn.Remat
    split: bool = False  # the module's parameters have several dtypes: this is the group of ``dtype``
    optional: bool = False  # some ranks may skip it: gathered at the start, reduced at the end (Plan(optional=))
    # After its forward: False keeps the gathered parameters for backward, True lets go of
    # them (backward gathers again), an int k keeps them sharded over groups of k ranks
    # (backward gathers within the group): see shardfn._state.resolve.reshard_rules.
    reshard: bool | int = False
    flat: bool = False  # Placement.FLAT ([Note: placements])
    frozen_split: bool = False  # a flat unit of a module that also has trainable (or frozen) leaves of its dtype
    whole: bool = False  # its leaves live whole on one rank each (shardfn.whole)

    @property
    def subgroup(self) -> int | None:
        """The size of the group the unit reshards to after forward (``reshard`` an int), else None."""
        return None if isinstance(self.reshard, bool) else self.reshard

    @property
    def name(self) -> str:
        base = self.path or "<root>"
        tags = [str(self.dtype).removeprefix("torch.")] if self.split else []
        tags += ["whole"] if self.whole else []
        tags += ["frozen"] if self.frozen_split and not self.grad_numel else []
        return f"{base}[{','.join(tags)}]" if tags else base


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """One buffer: replicated on every rank, never sharded (see [Note: the state tree])."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    persistent: bool  # in model.state_dict(), so in gather(), checkpoints and exports


@dataclasses.dataclass(frozen=True)
class IgnoredLayout:
    """One parameter outside the plan (``shard(ignored=)``, [Note: ignored parameters] in resolve.py)."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Layout:
    """What every rank agrees on about a sharded tree. Printing it shows the plan."""

    plan: Plan
    mesh_shape: tuple[int, ...]
    world: int  # ranks the parameters are split over (1 under NO_SHARD)
    replicas: int  # ranks each shard is replicated over (the all-reduce group size)
    leaves: Mapping[str, LeafLayout]
    units: tuple[UnitLayout, ...]
    buffers: Mapping[str, BufferLayout] = dataclasses.field(default_factory=dict)
    aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # leaf or buffer -> its names
    state_dict_keys: tuple[tuple[str, str], ...] = ()  # (model.state_dict() key, leaf or buffer name)
    tensor: tuple[tuple[str, str], ...] = ()  # (module path, style) of each split layer (shardfn._parallel.tensor)
    splits: tuple[Any, ...] = ()  # shardfn._parallel.ops.Split of each split leaf; leaves[leaf]: its piece
    ignored: Mapping[str, IgnoredLayout] = dataclasses.field(default_factory=dict)  # whole on every rank

    # [Note: facts of a layout]
    # The strategy is read here and in the plan and its resolution (shardfn._state.resolve), and
    # nowhere else: the runtime reads what it implies as these facts (and each unit's
    # UnitLayout.reshard), so one decision has one place, as Megatron-FSDP and veScale
    # resolve a strategy into per-buffer facts. tests/test_structure.py holds the rule.
    @property
    def strategy(self) -> Strategy:
        return self.plan.strategy

    @property
    def sharded(self) -> bool:
        """Whether the ranks of the shard axis hold different shards (all but NO_SHARD)."""
        return self.plan.strategy.sharded

    @property
    def gathers(self) -> bool:
        """Whether a unit's full parameters take an all-gather: shards on more than one rank."""
        return self.world > 1

    @property
    def reduction(self) -> Reduction:
        """How the gradients are reduced: over the shard axis, the replicas, both, or not at all."""
        if self.world > 1:
            return Reduction.REDUCE_SCATTER_ALL_REDUCE if self.replicas > 1 else Reduction.REDUCE_SCATTER
        return Reduction.ALL_REDUCE if self.replicas > 1 else Reduction.NONE

    @property
    def keeps_replica(self) -> bool:
        """Whether the full parameters stay gathered between steps (SHARD_OPTIMIZER: [Note:
        replicated parameters]): a step gathers the updated shards after the update."""
        return self.plan.strategy is Strategy.SHARD_OPTIMIZER

    @property
    def offloaded(self) -> bool:
        """Whether the shards, their gradients and the optimizer state live in host memory."""
        return self.plan.offload.enabled

    def shard_rank(self, mesh: Any) -> int:
        """Which dim-0 chunk of every parameter this rank of ``mesh`` holds (0 under NO_SHARD)."""
        return mesh.axis_rank("shard") if self.sharded else 0

    def local_rows(self, name: str, rank: int) -> int:
        """Placement.ROWS: real (non-padding) rows of parameter ``name`` held by shard rank ``rank``."""
        leaf = self.leaves[name]
        return leaf.local_rows(rank) if self.world > 1 else leaf.rows

    def shard_shape(self, name: str, rank: int) -> tuple[int, ...]:
        """The shape of parameter ``name``'s shard on shard rank ``rank`` (see [Note: placements]);
        an ignored parameter's is its whole shape."""
        if name in self.ignored:
            return self.ignored[name].shape
        got = self._memo.get((name, rank))
        if got is None:
            leaf = self.leaves[name]
            got = leaf.shard_shape if not leaf.flat else (leaf.piece(rank, self.units[leaf.unit].numel)[1],)
            self._memo[(name, rank)] = got
        return got

    def local_shard(self, name: str, full: torch.Tensor, rank: int, device: torch.device) -> torch.Tensor:
        """Shard rank ``rank``'s shard of parameter ``name`` from its full value, a new tensor on ``device``."""
        if name in self.ignored:  # (whole)
            return full.detach().to(device, copy=True)
        leaf = self.leaves[name]
        return local_shard(full, leaf, rank, device, self.units[leaf.unit].numel)

    def piece(self, name: str, rank: int) -> tuple[int, int]:
        """``(offset, length)`` of parameter ``name``'s shard in shard rank ``rank``'s shard
        buffer of its unit (``length`` elements, padding rows included under ROWS)."""
        leaf = self.leaves[name]
        return leaf.piece(rank, self.units[leaf.unit].numel)

    def offsets(self, unit: UnitLayout, rank: int) -> tuple[int, ...]:
        """Where each of ``unit``'s leaves' shards starts in ``rank``'s shard buffer, in unit order."""
        got = self._memo.get((unit.index, rank))
        if got is None:
            got = self._memo[(unit.index, rank)] = tuple(self.leaves[n].piece(rank, unit.numel)[0] for n in unit.leaves)
        return got

    @functools.cached_property
    def _memo(self) -> dict[tuple[Any, int], tuple[int, ...]]:
        """What :meth:`shard_shape` (by leaf name and rank) and :meth:`offsets` (by unit index
        and rank) computed: a step asks for them once per leaf or unit and gather, and a
        layout never changes."""
        return {}

    def unit_of(self, path: str) -> UnitLayout:
        return self.units[self.leaves[path].unit]

    @property
    def num_params(self) -> int:
        return sum(math.prod(leaf.shape) for leaf in self.leaves.values())

    def shard_bytes(self) -> int:
        """Bytes of this rank's parameter shards (padding included); the same on every rank."""
        return sum(u.numel * u.dtype.itemsize for u in self.units)

    def buffer_bytes(self) -> int:
        """Bytes of the buffers every rank holds."""
        return sum(math.prod(b.shape) * b.dtype.itemsize for b in self.buffers.values())

    def full_bytes(self) -> int:
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in self.leaves.values())

    @functools.cached_property
    def buckets(self) -> tuple[tuple[int, ...], ...]:
        """The units whose gradient reductions travel together, as tuples of unit indices in
        layout order; every unit that reduces is in exactly one (shardfn._group.buckets,
        [Note: buckets])."""
        return reduce_buckets(self)

    @functools.cached_property
    def gather_buckets(self) -> tuple[tuple[int, ...], ...]:
        """The units whose all-gathers travel together, as tuples of unit indices in layout
        order; every unit is in exactly one ([Note: buckets])."""
        return gather_buckets(self)

    def bucket_of(self, unit: UnitLayout) -> tuple[int, ...]:
        """The bucket holding ``unit`` (``(unit.index,)`` when it reduces alone or not at all)."""
        return self._bucket_index.get(unit.index, (unit.index,))

    @functools.cached_property
    def _bucket_index(self) -> dict[int, tuple[int, ...]]:
        return {i: b for b in self.buckets for i in b}

    def bucket_name(self, bucket: tuple[int, ...]) -> str:
        """How collectives and ``explain`` name a bucket: its unit, or its first and last units."""
        first, last = self.units[bucket[0]].name, self.units[bucket[-1]].name
        return first if len(bucket) == 1 else f"{first}..{last}"

    @functools.cached_property
    def names_by_id(self) -> dict[int, str]:
        """The header word of every unit's and bucket's name -> the name (shardfn._comm.guard), so
        that a rank can name in a divergence message a unit only its peers ran."""
        names = [u.name for u in self.units] + [self.bucket_name(b) for b in self.buckets + self.gather_buckets]
        return {unit_id(n): n for n in names if n}

    def collectives_per_step(self) -> dict[str, tuple[int, int]]:
        """Expected ``{kind: (count, bytes)}`` of one training step on one rank.

        FULL_SHARD gathers every unit twice (forward, backward) except the root unit,
        which stays gathered from its forward into its backward (as FSDP2's root does);
        more exactly, every unit resharded after forward (``UnitLayout.reshard``, see
        ``Plan(reshard_after_forward=...)``) is gathered twice.
        (A unit whose parameters backward never reads, such as a first layer whose input
        needs no gradient, is not gathered again: a step then issues one all-gather fewer
        than this predicts, which counts two for every non-root unit.)
        SHARD_GRAD_OP gathers once; all reduce-scatter once. Units in one bucket share
        its collectives (:attr:`gather_buckets`, :attr:`buckets`); NO_SHARD all-reduces
        once per bucket. The hybrid strategies do what FULL_SHARD / SHARD_GRAD_OP do over the
        ``shard`` axis, then all-reduce each unit's shard-sized gradient over
        ``replicate``. An axis of size one issues nothing. Not counted here: the step's
        metrics all-reduce per mesh axis (8 bytes, plus 4 per floating-point buffer), and
        the all-reduce that averages buffers some rank's forward changed.
        """
        out: dict[str, tuple[int, int]] = {}
        for u in self.units:
            for kind, (count, nbytes) in self.unit_collectives(u).items():
                c, b = out.get(kind, (0, 0))
                out[kind] = (c + count, b + nbytes)
        # a bucket's units share its collectives ([Note: buckets])
        shared = sum(len(b) - 1 for b in self.buckets)
        kind = "all_reduce" if self.world == 1 else "reduce_scatter"
        if shared:
            c, b = out[kind]
            out[kind] = (c - shared, b)
        shared = sum((len(b) - 1) * (2 if self.units[b[0]].reshard else 1) for b in self.gather_buckets)
        if shared:
            c, b = out["all_gather"]
            out["all_gather"] = (c - shared, b)
        return out

    def unit_collectives(self, u: UnitLayout) -> dict[str, tuple[int, int]]:
        """``{kind: (count, bytes)}`` of unit ``u`` in one step on one rank (see above)."""
        out: dict[str, tuple[int, int]] = {}
        item, red = u.param_dtype.itemsize, u.reduce_dtype.itemsize
        if self.world > 1:
            # gathered again in backward when resharded after forward (within a sub-group of
            # u.reshard ranks for an int: the same output, the whole unit)
            n = 2 if u.reshard else 1
            out["all_gather"] = (n, n * self.world * u.numel * item)
            if u.grad_numel:
                out["reduce_scatter"] = (1, self.world * u.grad_numel * red)
        if self.replicas > 1 and u.grad_numel:  # NO_SHARD; hybrid's shard-sized gradient
            out["all_reduce"] = (1, u.grad_numel * red)
        return out

    def fingerprint(self) -> int:
        """A 63-bit hash of everything that must agree across ranks."""
        text = repr((self.plan, self.mesh_shape, self.world, self.replicas, list(self.leaves.values()), self.units,
                     list(self.buffers.values()), sorted(self.aliases.items()), self.state_dict_keys,
                     self.tensor, self.splits, list(self.ignored.values())))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def __str__(self) -> str:
        mb = 1 / 2**20
        width = 18 if self.splits else 12
        lines = [
            f"Layout({self.strategy.value}, mesh {self.mesh_shape}, units={self.plan.units!r}"
            + (f", precision={self.plan.precision!r}" if self.plan.precision.param or self.plan.precision.reduce else "")
            + (f", offload={self.plan.offload!r}" if self.offloaded else "")
            + f", placement {getattr(self.plan.placement, 'value', self.plan.placement)}): "
            f"{params_text(self.num_params, self.leaves, self.splits)}, {self.full_bytes() * mb:.2f} MiB full{' per tensor rank' if self.splits else ''}, "
            f"{self.shard_bytes() * mb:.2f} MiB of shards per rank"
            + (f", {len(self.buffers)} buffers ({self.buffer_bytes() * mb:.2f} MiB, replicated)" if self.buffers else ""),
            f"  {'unit':<24} {'params' + ('/tensor rank' if self.splits else ''):>{width}} {'shard MiB/rank':>15} "
            f"{'pad elems':>10}  leaves",
        ]
        for u in self.units:
            n = sum(math.prod(self.leaves[p].shape) for p in u.leaves)
            pad = u.numel * self.world - n
            lines.append(
                f"  {u.name:<24} {n:>{width},} {u.numel * u.dtype.itemsize * mb:>15.3f} {pad:>10}  {len(u.leaves)}"
            )
        if self.tensor:
            lines.append(f"  split over the mesh's 'tensor' axis: {styles_text(self.tensor)}")
        if self.ignored:
            lines.append(f"  ignored (whole on every rank, outside the units): {len(self.ignored)} parameters")
        per_step = self.collectives_per_step()
        if per_step:
            alone = {k: sum(self.unit_collectives(u).get(k, (0, 0))[0] for u in self.units) for k in per_step}
            desc = ", ".join(f"{c} {k} ({b * mb:.2f} MiB"  # and how many the units would issue without buckets
                             + (f"; buckets merge the units' {alone[k]} into {c})" if alone[k] != c else ")")
                             for k, (c, b) in per_step.items())
            lines.append(f"  per step and rank: {desc}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        buffers = f", {len(self.buffers)} buffers" if self.buffers else ""
        return f"Layout({self.strategy.value}, mesh={self.mesh_shape}, {len(self.leaves)} leaves, {len(self.units)} units{buffers})"


def unit_owner(name: str, unit_paths: Sequence[str]) -> str:
    """The unit that owns the tensor or module at ``name``: the longest unit path that is
    ``name`` or a prefix of it (a unit owns everything below it); ``""``, the root unit,
    when none is."""
    return max((u for u in unit_paths if u and (name == u or name.startswith(u + "."))), key=len, default="")


def build_layout(plan: Plan, mesh_shape: tuple[int, ...], world: int, replicas: int, state: Mapping[str, torch.Tensor],
                 unit_paths: list[str], info: TreeInfo, unit_modules: Mapping[str, Any] | None = None,
                 remat: Mapping[str, RematMode] | None = None, optional: frozenset[str] = frozenset(),
                 reshard: Mapping[str, bool | int] | None = None, ignored: frozenset[str] = frozenset()) -> Layout:
    """Assigns each parameter of ``state`` to a unit and computes chunks and offsets.

    ``info`` names the parameters, buffers and aliases (see [Note: the state tree]); a
    parameter whose aliases fall into different units goes to the root unit, which is
    gathered for the whole forward, so each of its uses sees it. ``unit_modules`` (path
    -> module, when the module tree is known) lets precision overrides match by type.
    """
    unit_modules = unit_modules or {}
    members: dict[str, list[str]] = {"": [], **{u: [] for u in unit_paths}}
    for name in info.params:
        if name in ignored:
            continue
        owners = {unit_owner(a, unit_paths) for a in info.aliases.get(name, (name,))}
        members[owners.pop() if len(owners) == 1 else ""].append(name)

    leaves: dict[str, LeafLayout] = {}
    units: list[UnitLayout] = []
    whole_totals = [0] * world  # elements of whole leaves each rank holds so far (see whole_starts)
    for path, names in members.items():
        if not names:
            continue
        # [Note: mixed dtypes in a unit] A unit is one flat buffer per dtype: a module whose
        # parameters have several dtypes (a bf16 block with fp32 LoRA adapters or norms) is
        # one unit per dtype group, all on the same module, in order of first appearance.
        # Each group is gathered, reduced and accounted for on its own (one collective per
        # group and direction), in its own dtype unless the Precision says otherwise.
        flat = plan.placement is not Placement.ROWS
        pick = plan.placement.picks if isinstance(plan.placement, Whole) else None
        groups: dict[tuple[torch.dtype, bool, bool], list[str]] = {}
        for n in names:  # a flat unit is all trainable or all frozen ([Note: placements])
            whole = pick is not None and pick(n, tuple(state[n].shape))
            groups.setdefault((state[n].dtype, flat and not state[n].requires_grad, whole), []).append(n)
        dtypes = {dt for dt, _, _ in groups}
        for (master, frozen, whole), group in groups.items():
            starts = whole_starts(group, state, world, whole_totals) if whole else {}
            offset = grad_offset = 0
            for n in group:
                t = state[n]
                rows = t.shape[0] if t.dim() else 1
                chunk = -(-rows // world)
                numel = chunk * (math.prod(t.shape[1:]) if t.dim() else 1)
                # Frozen leaves are gathered with their unit but have no gradient: they take
                # no space in the reduce-scatter (or all-reduce) buffer.
                goff = grad_offset if t.requires_grad else -1
                if flat:  # laid end to end in the global buffer (whole: in one rank's range); chunk and offset unused
                    numel = math.prod(t.shape)
                    start = starts.get(n, offset)
                    leaves[n] = LeafLayout(n, tuple(t.shape), t.dtype, t.requires_grad, len(units), 0, -1,
                                           start if t.requires_grad else -1, start)
                else:
                    leaves[n] = LeafLayout(n, tuple(t.shape), t.dtype, t.requires_grad, len(units), chunk, offset,
                                           goff)
                offset += numel
                grad_offset += numel if t.requires_grad else 0
            if flat:  # offsets so far are global; a rank's shard buffer is 1 / world of it, padded at the end
                offset = starts.pop("", 0) if whole else -(-offset // world)
                grad_offset = offset if not frozen else 0
            param_dtype, reduce_dtype = plan.precision.unit_dtypes(path, unit_modules.get(path), master)
            units.append(UnitLayout(
                len(units), path, tuple(group), offset, master, grad_offset, param_dtype, reduce_dtype,
                (remat or {}).get(path), len(dtypes) > 1, path in optional,
                (reshard or {}).get(path, plan.strategy.reshard_after_forward and path != ""), flat,
                flat and any((master, not frozen, w) in groups for w in (False, True)), whole,
            ))
    buffers = {
        n: BufferLayout(n, tuple(state[n].shape), state[n].dtype, n in info.persistent) for n in info.buffers
    }
    return Layout(
        plan, mesh_shape, world, replicas, {n: leaves[n] for n in info.params if n not in ignored}, tuple(units),
        buffers, dict(info.aliases), info.state_dict_keys,
        ignored={n: IgnoredLayout(n, tuple(state[n].shape), state[n].dtype, state[n].requires_grad)
                 for n in info.params if n in ignored},
    )
