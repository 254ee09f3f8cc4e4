"""The header the ranks exchange before a collective (see [Note: the schedule guard] in
shardfn._comm.guard): its words, and how a header and a disagreement read in an error.

A header is :data:`HEADER` int64 words: what (dtype, kind, purpose), unit (a hash of its
name), bytes, detail, where, status and position. shardfn._comm.guard builds and exchanges them;
this module only says what the words mean, so a message and its fix live in one place.
"""

from __future__ import annotations

import zlib

import torch

from .events import Collective, Purpose
from .scope import Where

__all__ = ["HEADER", "Failure", "Where", "describe_header", "fix", "label", "unit_id"]


HEADER = 7
WHAT, UNIT, NBYTES, DETAIL, WHERE, STATUS, POSITION = range(HEADER)
OK = 0  # a status >= FAILED is FAILED + the failing rank's incident number
FAILED = 1
DIVERGED = -1  # a rank whose step left the schedule of the previous steps (shardfn._comm.pipelined)

_KINDS = list(Collective)
_PURPOSES = list(Purpose)
_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


class Failure:
    """Where a rank that failed was (the ``detail`` of its failed header): before the step's
    point of no return, or after it, when the others update (shardfn._run.no_return [Note: the point
    of no return]); or in a pipelined step whose collectives it could not play out for the
    others (shardfn._comm.failures.unplayable)."""

    BEFORE = 0  # nothing changed on any rank
    KEPT = 1  # after it: this rank's state is as before the step
    PARTLY = 2  # after it: this rank's state may be partly updated
    UNPLAYED = 3  # before it, in a pipelined step it could not play out: the process group is unusable


def unit_id(name: str) -> int:
    """The header word for a unit's name (a hash of it; 0 for none)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF if name else 0


# Contexts that issue collectives and agree on their end (:func:`agree_exit`): their names
# and the fix.
_CONTEXTS = {
    "shardfn.bind(...)": (
        "Inside `with shardfn.bind(...)` every forward all-gathers its units on every rank together, so every rank "
        "must make the same calls there: the same forwards, the same number of generated tokens (Hugging Face's "
        "generate: pass synced_gpus=True when ranks may stop at different lengths)."),
    "shardfn.on_shards(...)": (
        "Inside `with shardfn.on_shards(...)` every psum (global_norm, clip_by_global_norm) is collective: every "
        "rank must run the same ones, in the same order."),
}


def label(purpose: Purpose, unit: str) -> str:
    return f"{purpose.value} of {unit or 'the root'}" if purpose in (Purpose.GATHER, Purpose.REGATHER,
                                                                      Purpose.REDUCE) else purpose.value


def describe_header(h: list[int], names: dict[int, str]) -> str:
    """One rank's header in words; ``names``: the unit names this rank knows (``Guard.names``)."""
    kind, purpose = _KINDS[h[WHAT] // 64 % 64], _PURPOSES[h[WHAT] % 64]
    if purpose is Purpose.STEP:
        plan = f"pipelined, schedule {h[UNIT]:08x} of {h[NBYTES]} collectives" if h[UNIT] else "checked"
        return f"step start ({plan}), {Where.NAMES.get(h[WHERE], '?')}"
    if purpose is Purpose.METRICS and h[NBYTES] < 0:
        return "the end of its forward and backward (the metrics all-reduce next), in a step"
    if purpose is Purpose.EXIT:
        return f"the end of its `with {names.get(h[UNIT], '?')}` block (no more collectives in it)"
    code = h[WHAT] // 4096
    dtype = f" {str(_DTYPES[code]).removeprefix('torch.')}" if 0 < code < len(_DTYPES) else ""
    unit = names.get(h[UNIT], f"unit #{h[UNIT]:x}") if h[UNIT] else ""
    tokens = f", {h[DETAIL] >> 32} tokens" if h[DETAIL] >> 32 else ""
    detail = (f", batch of {h[DETAIL] & 0xFFFFFFFF} rows{tokens}" if purpose is Purpose.METRICS and h[DETAIL] > 0 else
              f", checkpoint {h[DETAIL]:08x}" if purpose is Purpose.CHECKPOINT and h[DETAIL] else
              _skipped(h[DETAIL], names) if purpose is Purpose.REDUCE and h[DETAIL] else "")
    return (f"{kind.value} ({label(purpose, unit)}), {h[NBYTES]:,} bytes{dtype}{detail}, "
            f"{Where.NAMES.get(h[WHERE], '?')}")


def _skipped(detail: int, names: dict[int, str]) -> str:
    """A bucket's reduction whose members this rank did not run (shardfn._group.buckets.skipped_detail)."""
    first, count = names.get(detail & 0xFFFFFFFF, f"unit #{detail & 0xFFFFFFFF:x}"), detail >> 32
    return f", without {first}{f' and {count - 1} more of its units' if count > 1 else ''} (not run on this rank)"


def fix(headers: list[list[int]], names: dict[int, str]) -> str:
    """What to do about ranks whose headers are ``headers``."""
    same_but_rows = all(h[:DETAIL] + h[DETAIL + 1:STATUS] == headers[0][:DETAIL] + headers[0][DETAIL + 1:STATUS]
                        for h in headers)
    exits = [names.get(h[UNIT], "") for h in headers if _PURPOSES[h[WHAT] % 64] is Purpose.EXIT]
    if exits:
        fix = _CONTEXTS.get(exits[0], "Every rank must make the same collective calls inside the block.")
    elif any(_PURPOSES[h[WHAT] % 64] is Purpose.USER for h in headers):
        fix = ("mesh.barrier, broadcast, reduce and all_gather are collective: every rank must call them, in the "
               "same order, with tensors of the same shape and dtype (all_gather: pad to one shape first).")
    elif same_but_rows and _PURPOSES[headers[0][WHAT] % 64] is Purpose.CHECKPOINT:
        fix = ("The ranks were about to load different checkpoints (their shardfn.json differ: a hash of each is "
               "shown). Pass the same path on every rank, in a directory every rank sees the same (a shared "
               "filesystem), and do not write into it while loading.")
    elif same_but_rows and _PURPOSES[headers[0][WHAT] % 64] is Purpose.REDUCE:
        fix = _UNITS_FIX  # a bucket some of whose units some ranks did not run
    elif same_but_rows and len({h[DETAIL] & 0xFFFFFFFF for h in headers}) == 1:  # as many rows: the tokens differ
        fix = ("The ranks' batches have as many rows but different numbers of tokens (the elements of the batch's "
               "first integer tensor): a plain mean loss would weight every rank's mean equally, which is not the "
               "mean over the global batch's tokens. Return shardfn.Mean(total, count) from loss_fn (the sum of the "
               "per-token losses and the number of tokens) to weight every token exactly, or give every rank the "
               "same number of tokens.")
    elif same_but_rows:
        fix = ("A plain mean loss over batches of different sizes would weight every rank's mean equally, which is "
               "not the mean over the global batch. Give every rank the same number of rows, or return "
               "shardfn.Mean(total, count) from loss_fn to weight every element exactly.")
    elif len({h[WHERE] for h in headers}) > 1:
        fix = ("Every rank must make the same shardfn calls in the same order: a step, apply on shards, shard(), "
               "checkpoint.save/load are collective. Evaluate (apply outside a step) on every rank, or on none.")
    elif any(_PURPOSES[h[WHAT] % 64] is Purpose.STEP for h in headers):
        fix = ("The ranks started a step with different histories: a different step function (jit_step / jit_grad "
               "object) on some ranks, or one that some ranks called more often. Call the same step on every rank.")
    else:
        fix = _UNITS_FIX
    return fix


_UNITS_FIX = (
    "Every rank must run the same units in the same order, the same number of times, whether a unit travels in a "
    "bucket or alone. A module that only some ranks run (experts chosen by the data, LayerDrop, a branch taken for "
    "some batches) must not be a unit of its own: make units of modules every rank runs (e.g. the blocks that "
    "hold the experts: units=by_module_type(Block), as the default unit policy does), or declare it optional "
    "(shard(..., optional=...) or Plan(optional=...)): every rank then gathers and reduces it, with zero gradients "
    "where it did not run.")
