"""Backward as CUDA runs it, on the CPU: without the caller's ``ContextVar``s.

On CUDA, autograd's engine runs a graph's backward on its device threads. The engine
copies torch's thread-local state into them (grad mode, the dispatch-mode stack that
``make_fx`` records through, saved-tensor hooks, autocast), but not Python's context: a
``ContextVar`` set by the thread that called ``torch.autograd.grad`` reads its default
there. On the CPU the engine runs backward on the calling thread, so a CPU test sees the
caller's values and would pass where a GPU fails.

:func:`backward_without_context` runs every ``torch.autograd.grad`` / ``torch.autograd.backward``
(and so ``Tensor.backward``) under a new, empty ``contextvars.Context`` on the calling
thread. That is the one difference that matters, reproduced exactly: every hook, saved-tensor
unpack and ``autograd.Function.backward`` sees the ContextVars' defaults, while torch's
thread-local state stays what it is, as the engine makes it on a device thread. A fresh
``threading.Thread`` would have to copy that state by hand (torch offers no Python handle
on its ``ThreadLocalState``), and a copy that missed a piece would fail for its own reason.
The empty context is stricter than CUDA in one way only: the few nodes a GPU's engine runs
on the calling thread (those on the CPU) lose the context too; shardfn must not need it there
either.
"""

import contextlib
import contextvars
from collections.abc import Iterator

import torch


class Backwards:
    """How many backward calls ran without the caller's context (a test asserts it is > 0,
    so that a patch that was never reached cannot pass)."""

    def __init__(self):
        self.calls = 0


@contextlib.contextmanager
def backward_without_context(empty: bool = True) -> Iterator[Backwards]:
    """In the block, ``torch.autograd.grad`` and ``torch.autograd.backward`` run under an
    empty ``contextvars.Context`` (see the module's docstring). ``empty=False`` only counts
    them: the same run in the caller's context, to compare with."""
    seen = Backwards()
    grad, backward = torch.autograd.grad, torch.autograd.backward

    def in_empty_context(fn):
        def run(*args, **kwargs):
            seen.calls += 1
            return contextvars.Context().run(fn, *args, **kwargs) if empty else fn(*args, **kwargs)
        return run

    torch.autograd.grad, torch.autograd.backward = in_empty_context(grad), in_empty_context(backward)
    try:
        yield seen
    finally:
        torch.autograd.grad, torch.autograd.backward = grad, backward
