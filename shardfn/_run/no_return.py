"""The step's point of no return: an optimizer's outputs checked before anything is written,
and where a rank was when it failed after the ranks agreed to update; and the signatures of
optimizer states that these checks (and the step's check of its state) compare.

[Note: the point of no return]
The metrics all-reduce is the ranks' last agreement in a step: after it every rank updates.
So what can fail there is made to fail before any write where it can: an optimizer without
an in-place update_ computes its updates and new state into new tensors, checked against
the shards and the old state (check_outputs) before anything is added, and the built-in
update_ kernels advance their count last. What still fails after the agreement cannot be
taken back on the peers, which have updated (or are updating): the failing rank records
where it was (shardfn._comm.failures.failed_at: its state as before the step, KEPT, its forward's
buffers put back; or PARTLY updated, in place), its failed header carries that to the peers,
and every rank raises saying which ranks updated and which did not, never "nothing was
updated". The trees then are not one model across the ranks: each rank marks the tree it
holds Unusable (shardfn._state.verdict), and step, checkpoint.save, save_pretrained and gather
refuse it, naming shardfn.checkpoint.latest, until checkpoint.load replaces its values.
docs/ranks-that-differ.md, "A failure after the point of no return".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from .._errors import CommError, DivergenceError, PeerError
from .._comm.failures import failed_at
from .._comm.header import Failure

if TYPE_CHECKING:
    from .buffers import StepBuffers
    from .._state.sharded import ShardedParams

__all__ = ["after_agreement", "check_outputs", "quick", "signature"]


@contextmanager
def after_agreement(failure: int | None, buffers: StepBuffers | None = None, state: Any = None) -> Iterator[None]:
    """An error raised in the block was raised after the step's point of no return, this rank's
    state being ``failure`` (None: KEPT if the optimizer ``state`` is pure, else PARTLY; the
    first record stands: an inner block knows better); with ``buffers`` and KEPT, the buffers
    the forward changed are put back, so that it is so."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, (PeerError, DivergenceError, CommError)):  # (those, the guard reports itself)
            failure = failure if failure is not None else Failure.KEPT if _pure(state) else Failure.PARTLY
            if failed_at(e, failure) == Failure.KEPT and buffers is not None:
                buffers.restore()
        raise


def _pure(state: Any) -> bool:
    """Whether ``state`` is tensors and plain values only: an update that returns a new one
    leaves the one it was given as it was (from_torch's state object steps in place)."""
    return all(isinstance(x, (torch.Tensor, int, float, bool, str, type(None))) for x in pytree.tree_leaves(state))


def check_outputs(out: Any, old: Any, sharded: ShardedParams) -> tuple[Any, Any]:
    """``optimizer.update``'s ``(updates, new_state)``, checked before anything is written
    ([Note: the point of no return]): an update per trainable shard, of its shape, on its
    device, castable to its dtype; a new state with the old one's structure and placement."""
    problems = []
    updates, new = out if isinstance(out, tuple) and len(out) == 2 else (None, None)
    if not isinstance(updates, Mapping):
        problems.append(f"  update(...) returned a {type(out).__name__}, not (updates, new_state) with updates a "
                        "mapping name -> tensor")
        updates = {}
    for k, u in updates.items():
        p = sharded[k] if k in sharded.layout.leaves or k in sharded.layout.ignored else None
        if p is None or not p.requires_grad:
            problems.append(f"  updates[{k!r}]: there is no trainable parameter {k!r} in these shards")
        elif not isinstance(u, torch.Tensor):
            problems.append(f"  updates[{k!r}]: a {type(u).__name__}, not a tensor")
        elif u.shape != p.shape or u.device != p.device or not torch.can_cast(u.dtype, p.dtype):
            problems.append(f"  updates[{k!r}]: {tuple(u.shape)} {u.dtype} on {u.device}, where the shard is "
                            f"{tuple(p.shape)} {p.dtype} on {p.device}")
    if isinstance(out, tuple) and len(out) == 2 and (quick(new) != quick(old) or _devices(new) != _devices(old)):
        before, after = signature(old, devices=True), signature(new, devices=True)  # (dicts in another order pass)
        problems += [f"  new_state{q}: {after.get(q, 'missing')}, where the state given had {before.get(q, 'nothing')}"
                     for q in sorted(before.keys() | after.keys()) if before.get(q) != after.get(q)]
    if problems:
        raise ValueError(
            "step: the optimizer's update(grads, state, params) returned outputs that do not fit these shards, so "
            "nothing was written on this rank:\n" + "\n".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
            + "\nReturn (updates, new_state): one update per trainable shard, of its shape, on its device and "
            "castable to its dtype, and a new state of the same structure, shapes, dtypes and devices as the state.")
    return updates, new


def quick(tree: Any) -> Any:
    """The structure, and each leaf's shape and dtype (a tensor) or type: cheap to compare.

    Two are equal only where pytree flattens both alike and their leaves agree: a tree of
    dicts, lists, tuples and namedtuples is written as one list of its nodes (type, keys or
    length) and leaves in pytree's order, walked here without pytree's dispatch per node
    (a step checks its optimizer state with it every time); a tree with other pytree
    nodes, as pytree's spec and leaves (a tuple: never equal to such a list)."""
    out: list[Any] = []
    if _walk(tree, out):
        return out
    leaves, spec = pytree.tree_flatten(tree)
    return spec, [(x.shape, x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in leaves]


def _walk(x: Any, out: list[Any]) -> bool:
    """Appends what :func:`quick` says of ``x``; False at a pytree node other than those four."""
    t = type(x)
    if t is dict or t is list or t is tuple or (isinstance(x, tuple) and pytree.is_namedtuple_class(t)):
        out.append((t, tuple(x) if t is dict else len(x)))  # (pytree's context: a dict's keys, in order)
        for child in x.values() if t is dict else x:
            if type(child) is torch.Tensor or (isinstance(child, torch.Tensor)
                                               and type(child) not in pytree.SUPPORTED_NODES):
                out.append((child.shape, child.dtype))  # (a leaf: a tuple, never a node's (type, ...))
            elif not _walk(child, out):
                return False
        return True
    if t in pytree.SUPPORTED_NODES:
        return False
    out.append((x.shape, x.dtype) if isinstance(x, torch.Tensor) else t)
    return True


def _devices(tree: Any) -> list[torch.device | None]:
    return [x.device if isinstance(x, torch.Tensor) else None for x in pytree.tree_leaves(tree)]


def signature(tree: Any, devices: bool = False) -> dict[str, str]:
    """Path -> what is there (a tensor's shape and dtype, and with ``devices`` its device, else
    the type), for comparing states."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return {pytree.keystr(path): (f"tensor {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                                  + (f" on {x.device}" if devices else "")
                                  if isinstance(x, torch.Tensor) else type(x).__name__) for path, x in leaves}
