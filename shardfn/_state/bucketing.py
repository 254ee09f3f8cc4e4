"""Which units share a bucket: part of the layout, the same on every rank ([Note: buckets]
in shardfn._group.buckets, where a runtime's buckets issue their collectives)."""

from __future__ import annotations

from typing import Any

__all__ = ["FIRST_BUCKET_BYTES", "gather_buckets", "reduce_buckets"]

FIRST_BUCKET_BYTES = 2**20


def reduce_buckets(layout: Any) -> tuple[tuple[int, ...], ...]:
    """The units whose gradient reductions travel together, as tuples of unit indices in
    layout order; every unit that reduces is in exactly one (see [Note: buckets])."""
    reducing = [u for u in layout.units if u.grad_numel]
    no_shard = layout.reduction.all_reduces and not layout.reduction.scatters
    sharded = layout.reduction.scatters and not layout.reduction.all_reduces and not layout.offloaded
    if not ((no_shard or sharded) and layout.plan.bucket_bytes):
        return tuple((u.index,) for u in reducing)
    def solo(u: Any) -> bool:  # a unit that reduces in a bucket of its own
        return u.optional or (sharded and u.whole)

    out: list[list[int]] = []
    size, dtype = 0, None
    for u in reversed(reducing):
        nbytes = layout.world * u.grad_numel * u.reduce_dtype.itemsize  # the buffer: [world, gn]
        alone = solo(u) or (out and solo(layout.units[out[-1][0]]))
        cap = min(FIRST_BUCKET_BYTES, layout.plan.bucket_bytes) if len(out) == 1 else layout.plan.bucket_bytes
        if not out or alone or u.reduce_dtype != dtype or size + nbytes > cap:
            out.append([])
            size = 0
        out[-1].insert(0, u.index)
        size, dtype = size + nbytes, u.reduce_dtype
    return tuple(tuple(b) for b in reversed(out))


def gather_buckets(layout: Any) -> tuple[tuple[int, ...], ...]:
    """The units whose all-gathers travel together, as tuples of unit indices in layout
    order; every unit is in exactly one (see [Note: buckets])."""
    on = (layout.gathers and not layout.reduction.all_reduces and layout.plan.bucket_bytes  # (not hybrid)
          and not layout.offloaded and not layout.keeps_replica)
    out: list[list[int]] = []
    size, key = 0, None
    for u in layout.units:
        joins = bool(on and u.path and u.numel and not u.optional and u.remat is None and u.subgroup is None
                     and not u.whole)
        nbytes = layout.world * u.numel * u.param_dtype.itemsize
        mine = (u.param_dtype, bool(u.reshard)) if joins else None
        if mine is None or mine != key or size + nbytes > layout.plan.bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(u.index)
        size, key = size + nbytes, mine
    return tuple(tuple(b) for b in out)
