"""A graph step with the transformers styles, captured as a CUDA graph would capture it
(tests/fake_cuda.py: a fake graph as strict as CUDA's, whose replay runs the recorded ops on
the captured memory and none of the step's Python), equal bit for bit to the same step
uncaptured, at tensor 2: the per-head norms' gradient sum (Qwen3) and the whole heads'
gathers (OLMo 2) replay with the rest. No GPU is needed. (A mixture of experts' graph step
is refused when it is recorded: tests/test_tp_moe.py.)"""

import pytest
import torch

import shardfn as sf
import test_tp_styles
from bounds import SGD_MOMENTUM
from test_tp_auto import ROWS, SEQ, VOCAB, loss_fn

STEPS = 6  # eager, recorded, the program run eagerly, then captured once and replayed


def _batches():
    g = torch.Generator().manual_seed(4)
    return [{"x": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
             "y": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)} for _ in range(STEPS)]


def _run(name, captured):
    from fake_cuda import FakeCuda
    from shardfn._program import capture as _capture

    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(test_tp_styles.MODELS[name]())[0], mesh, "FULL_SHARD", tensor_parallel="auto")
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, graph="eager")
    fake, check = FakeCuda(), _capture.check_capturable
    if captured:  # (gloo stands in for NCCL: its functional collectives are what the fake graph records)
        step.graphs = fake
        _capture.check_capturable = lambda mesh: None
    try:
        losses = []
        for batch in _batches():
            sharded, state, metrics = step(sharded, state, batch)
            losses.append(float(metrics["loss"]))
    finally:
        _capture.check_capturable = check
    captures = [getattr(p.fn, "captures", None) for p in step.programs.values()]
    step.close()
    return losses, sf.gather(sharded), captures, len(fake.graphs)


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_a_captured_graph_step_equals_the_uncaptured_one(clusters, name):
    captured = clusters[2].run(_run, name, True)
    plain = clusters[2].run(_run, name, False)
    for (losses, params, captures, graphs), (want_losses, want, _, none) in zip(captured, plain):
        assert captures == [1] and graphs == 1 and none == 0, (captures, graphs, none)  # captured once, replayed
        assert losses == want_losses, (losses, want_losses)
        assert all(torch.equal(params[n], want[n]) for n in want), [n for n in want if not torch.equal(params[n], want[n])]
