"""The optimizers of the equivalence tests, and why their tolerances hold on any CPU.

[Note: tolerances after training]
A sharded run and the one-process reference compute each gradient as the same terms
summed in another order and blocking: a rank sums its slice of the rows, the ranks' sums
are added in rank order, and MKL and oneDNN block (and so round) differently for other
shapes and other instruction sets (AVX-512, AVX2). On the test models (gpt, mlp, moe)
the two gradients differ by at most dg = 6e-8, the same on the AVX-512 and AVX2 kernel
paths. What a training run makes of dg depends on the optimizer's update:

* SGD with momentum mu is linear in the gradient: k steps move a parameter by at most
  lr * sum_{t<=k} sum_{j<=t} mu^(t-j) * dg (SGD_MOMENTUM, 3 steps: 0.28 dg).
* AdamW's update lr * m/(sqrt(v) + eps) (bias-corrected) moves by at most
  lr * (1 + C) * dg / (sqrt(v) + eps) a step, C = max |m|/sqrt(v) <= 1.0014 in the first 3
  steps (Cauchy-Schwarz on the moments, b1^2 < b2). With torch's eps = 1e-8 that is up to
  2e8 * lr * dg: a gradient that cancels to near zero is scale-free, and its rounding
  becomes a step of up to lr, on one CPU and not on another (issue 38: an MoE expert moved
  4.3e-6 on an AMD EPYC). ADAMW takes eps = 1e-3: 3 steps move a parameter by at most
  3 * 2.0014 * (lr / eps) * dg = 6 dg.

Both bounds stay well inside check_equivalence's default atol = 1e-6 (up to dg = 3.5e-6
for SGD_MOMENTUM and 1.6e-7 for ADAMW), so a wrong shard, a lost gradient or a stale
moment fails and another CPU's rounding does not. ``tools/other_kernels.sh`` runs these
tests on a second kernel path, and the suite lists every check's margin at its end.
"""

import functools

from shardfn.optim import adamw, sgd

__all__ = ["ADAMW", "SGD_MOMENTUM", "adamw_bound", "sgd_bound"]

SGD_MOMENTUM = functools.partial(sgd, 0.05, momentum=0.9)
ADAMW = functools.partial(adamw, 1e-3, eps=1e-3, weight_decay=0.01)


def sgd_bound(lr: float, momentum: float, steps: int, dg: float) -> float:
    """How far ``steps`` SGD steps can move a parameter when each gradient moves by ``dg``."""
    return lr * dg * sum(sum(momentum**i for i in range(t)) for t in range(1, steps + 1))


def adamw_bound(lr: float, eps: float, steps: int, dg: float, b1: float = 0.9, b2: float = 0.999) -> float:
    """How far ``steps`` AdamW steps can move a parameter when each gradient moves by ``dg``
    (to first order; weight decay's share, lr * wd * dp, is second order)."""
    total = 0.0
    for t in range(1, steps + 1):
        a = [(1 - b1) * b1 ** (t - j) / (1 - b1**t) for j in range(1, t + 1)]
        w = [(1 - b2) * b2 ** (t - j) / (1 - b2**t) for j in range(1, t + 1)]
        c = sum(x * x / y for x, y in zip(a, w)) ** 0.5  # max |m| / sqrt(v) (Cauchy-Schwarz)
        total += lr * (1 + c) * dg / eps
    return total
