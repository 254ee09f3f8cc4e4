"""The key of a recorded program (``jit_step(graph=True)``), and the ranks agreeing on it.

[Note: a program's key]
A recorded program replays as constants whatever its recording read in Python. Its key
holds what of that the step can see: the structure, shapes, dtypes and devices of the
state and the batch, each batch leaf that is not a tensor (by value), and the plain
attributes of every module of the model (``training``, a dropout's ``p``: values of type
bool, int, float, str or None, or tuples of them, in each module's ``__dict__`` at the
step's first call), read per call from a list made once, and the plain values of a
``from_torch`` optimizer's param groups (``lr``, ``betas``: a torch LR scheduler changes them
between calls; a value of another kind, a tensor, by its identity). A call whose key has no
program records one. A forward that changes such an attribute itself (a call counter) would need a
program per call: refused when recorded. What the key cannot see (a global, a closure, an
attribute holding an object, one added later) is listed in docs/compile.md.

[Note: agreeing on the key]
A program issues its collectives without headers, so before it runs the ranks agree on
which: one header exchange per mesh axis ([Note: a fixed-size agreement]), its detail the
number of the program (the ranks record together, so the numbers match; the keys need not:
a rank's batch or shards may have shapes of their own), its bytes whether this rank has
it or records it. Equal: every rank replays, or every rank records. Otherwise no rank runs anything: each writes what changed since its
last call to the store, reads the others', and raises the same error naming every rank
whose key changed, what to, and what its program was recorded for.
"""

from __future__ import annotations

import datetime
import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .._comm import guard as G
from .._errors import DivergenceError
from .._comm.events import Collective, Purpose

__all__ = ["ModelAttributes", "agree_on_key", "group_values", "what_changed"]

_PLAIN = (bool, int, float, str, type(None))

_MOVED = (
    "[rank {rank}] jit_step(graph=True): this step cannot be recorded as one program: the step changed {changes}. "
    "A program replays the attributes its recording read as constants, so each call would need a program of its "
    "own. Fix: keep a value the forward updates in a buffer of the model (a tensor of the state) or pass it in "
    "the batch, or build the step with graph=False."
)

_DIFFER = (
    "[rank {rank}] shardfn: jit_step(graph=True): the ranks on {ranks} would run different programs, so none "
    "runs and nothing was updated: {changes}. The ranks run one program per call and record new ones "
    "together: change the batch shapes (pad batches to one shape, or drop the last one), the model's mode "
    "(apply.eval() / apply.train()) and a from_torch optimizer's param groups (its lr) on every rank alike, in "
    "the same call; or build the step with graph=False."
)


def _plain(value: Any) -> bool:
    return type(value) in _PLAIN or (type(value) is tuple and all(type(v) in _PLAIN for v in value))


def group_values(optimizers: list[Any]) -> tuple[Any, ...]:
    """Per param group of each torch optimizer, its values but ``params`` (see [Note: a
    program's key]): ``((name, value), ...)``, a value that is not plain as its type and id."""
    return tuple(tuple((k, v if _plain(v) else (type(v), id(v))) for k, v in group.items() if k != "params")
                 for optimizer in optimizers for group in optimizer.param_groups)


def _groups_changed(before: tuple[Any, ...], after: tuple[Any, ...], most: int = 4) -> str:
    """``param_groups[0]['lr']: 0.1 -> 0.01, ...``: what changed between two group_values."""
    if len(before) != len(after):
        return f"{len(before)} param groups -> {len(after)}"
    moved = [f"param_groups[{i}][{k!r}]: {a!r} -> {dict(b).get(k)!r}" for i, (g, b) in enumerate(zip(before, after))
             for k, a in g if dict(b).get(k) != a]
    return ", ".join(moved[:most] + ([f"{len(moved) - most} more"] if len(moved) > most else []))


class ModelAttributes:
    """The plain attributes of every module of ``root`` (see [Note: a program's key]): the
    list is made once; :meth:`values` reads them, as one tuple, per call."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.names: list[str] = []
        self.where: list[tuple[dict[str, Any], str]] = []
        for path, module in root.named_modules(remove_duplicate=True):
            for name, value in module.__dict__.items():
                if _plain(value):
                    self.names.append(f"{path}.{name}" if path else name)
                    self.where.append((module.__dict__, name))
        # one C call per module: values() is a tuple of each module's tuple (or single value)
        by_module: dict[int, tuple[dict[str, Any], list[str]]] = {}
        for d, name in self.where:
            by_module.setdefault(id(d), (d, []))[1].append(name)
        self._read = [(d, operator.itemgetter(*names), names) for d, names in by_module.values()]

    def values(self) -> tuple[Any, ...]:
        try:
            values = tuple([read(d) for d, read, _ in self._read])
        except KeyError:  # an attribute deleted since: None
            values = tuple([tuple(d.get(n) for n in names) if len(names) > 1 else d.get(names[0])
                            for d, _, names in self._read])
        try:
            hash(values)
        except TypeError:  # an attribute that now holds a list or an object: keyed by its identity
            values = tuple(v if _plain(v) else (type(v), id(v)) for v in self._flat(values))
        return values

    def _flat(self, values: tuple[Any, ...]) -> list[Any]:
        """One value per name of :attr:`names`."""
        if len(values) == len(self.names):
            return list(values)
        out: list[Any] = []
        for v, (_, _, names) in zip(values, self._read):
            out += list(v) if len(names) > 1 else [v]
        return out

    def changes(self, before: tuple[Any, ...], after: tuple[Any, ...], most: int = 4) -> list[str]:
        """``'drop.training: True -> False'`` for each attribute that differs (the first ``most``)."""
        moved = [f"{n}: {a!r} -> {b!r}" for n, a, b in zip(self.names, self._flat(before), self._flat(after)) if a != b]
        return moved[:most] + ([f"{len(moved) - most} more"] if len(moved) > most else [])


def refuse_moved(rank: int, attributes: ModelAttributes | None, before: tuple[Any, ...]) -> None:
    """Raises ValueError when the step just run changed a module attribute (see [Note: a
    program's key])."""
    if attributes is None:
        return
    after = attributes.values()
    if after != before:
        changes = ", ".join(attributes.changes(before, after))
        raise ValueError(_MOVED.format(rank=rank, changes=f"module attributes ({changes})"))


def _batch(key: Any) -> str:
    """The batch part of a key in words: ``x: (4, 8) int64, y: ...``."""
    bspec, leaves = key[1], key[2]
    paths = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(len(leaves))), bspec))[0]
    words = []
    for (path, _), leaf in zip(paths, leaves):
        what = (f"{tuple(leaf[0])} {str(leaf[1]).removeprefix('torch.')}" if isinstance(leaf, tuple) and len(leaf) == 3
                and isinstance(leaf[0], torch.Size) else repr(leaf))
        words.append(f"batch{pytree.keystr(path)}: {what}")
    return ", ".join(words)


def what_changed(rank: int, key: Any, last: Any, recorded: bool, attributes: ModelAttributes | None) -> str:
    """What ``rank``'s key ``key`` changed from ``last`` (the key of its last call; None
    before any), in words; '' when it did not change."""
    if last is None or key == last:
        return ""
    was = "its program was recorded for" if recorded else "its last call (eager, the first) ran"
    parts = []
    if key[1:3] != last[1:3]:
        parts.append(f"rank {rank}'s batch changed shape ({_batch(key)}); {was} ({_batch(last)})")
    if key[3] != last[3] and attributes is not None:
        parts.append(f"rank {rank}'s model changed ({', '.join(attributes.changes(last[3], key[3]))})")
    if key[4] != last[4]:
        parts.append(f"rank {rank}'s optimizer hyperparameters changed ({_groups_changed(last[4], key[4])})")
    if key[0] != last[0] and last[0] is not None:  # (None: the first call, whose state was not keyed)
        parts.append(f"rank {rank}'s state (the shards or the optimizer state) changed structure, shape or dtype")
    return "; ".join(parts)


def agree_on_key(mesh: Any, scope: Any, number: int, has_program: bool, change: Any, nonfinite: bool = False,
                 error: Any = None) -> None:
    """Every rank of ``mesh`` runs its program ``number`` (programs are numbered as the ranks
    recorded them, together), or records it (``has_program`` False), or every rank raises the
    same DivergenceError naming the ranks whose key changed (``change()``: this rank's, from
    :func:`what_changed`); see [Note: agreeing on the key]. ``nonfinite``: this rank read a
    verdict that is not finite; the header's unit word carries it on, axis after axis, and if
    any rank's is True every rank raises ``error()`` after the last axis (shardfn._state.verdict
    [Note: reading a verdict when it is ready]). Call it inside ``G.guarded``, so that an axis
    that raises tells the others, with the scope it yields."""
    told = []
    for axis in mesh.axis_names:
        ch = mesh.channel(axis)
        if ch.off:
            continue
        what = "the key of jit_step(graph=True)'s program"
        mine = G.words(Collective.BARRIER, Purpose.STEP, "", int(has_program), number, None, scope.where)
        mine[G.UNIT] = int(nonfinite)
        position = ch.position
        headers = G.exchange(ch, [*mine, G.OK, 0], what, scope)
        told.append(ch)
        if not all(h[G.WHAT] == mine[G.WHAT] and h[G.WHERE] == mine[G.WHERE] for h in headers):
            raise G.told(DivergenceError(G._diverged(ch, headers)), ch)  # a peer doing something else
        nonfinite = nonfinite or any(h[G.UNIT] for h in headers)
        if nonfinite or all(h[G.UNIT + 1:G.STATUS] == headers[0][G.UNIT + 1:G.STATUS] for h in headers):
            continue
        raise G.told(DivergenceError(_differ(ch, position, change(), headers)), ch)
    if nonfinite:
        exc = error()
        for ch in told:
            G.told(exc, ch)
        raise exc


def _differ(ch: Any, position: int, change: str, headers: list[list[int]]) -> str:
    """The message every rank of ``ch`` builds alike: each rank's change, read from the store."""
    store = dist.distributed_c10d._get_default_store()
    base = f"shardfn/graphkey/{'-'.join(map(str, ch.ranks))}/{position}/"
    store.set(base + str(dist.get_rank()), change)
    changes = []
    try:
        store.wait([base + str(r) for r in ch.ranks], datetime.timedelta(seconds=ch.timeout))
        said = [store.get(base + str(r)).decode(errors="replace") for r in ch.ranks]
    except Exception as e:  # noqa: BLE001 - the store is gone with its host: the digests must do
        said = [""] * len(ch.ranks)
        changes.append(f"(what changed could not be read from the store: {e})")
    same = [r for r, s in zip(ch.ranks, said) if not s]
    changes = [s for s in said if s] + changes
    if not [s for s in said if s]:  # every key is as before, yet they differ: the ranks' histories do
        changes.append("no rank's key changed since its last call, yet they would run " + ", ".join(
            f"rank {r}: {'program' if h[G.NBYTES] else 'a new recording'} #{h[G.DETAIL]}" for r, h in zip(ch.ranks, headers))
            + " (their histories differ: a rank that skipped a call or built another step)")
    if same and len(same) < len(ch.ranks):
        changes.append(f"rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))} did not change")
    return _DIFFER.format(rank=dist.get_rank(), ranks=list(ch.ranks), changes="; ".join(changes))
