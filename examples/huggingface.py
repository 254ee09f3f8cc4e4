"""Train a Hugging Face GPT-2 with shardfn, resume it at another world size, export, generate.

docs/huggingface.md walks through it. Two commands (the second continues the first)::

    torchrun --nproc-per-node 2 examples/huggingface.py --steps 4 --ckpt-dir runs/hf-ckpt
    python examples/huggingface.py --steps 8 --ckpt-dir runs/hf-ckpt --export runs/hf-gpt2

The first trains 4 steps on 2 processes and saves a sharded checkpoint; the second is a
plain ``python`` run, a world of one, that loads it, trains to step 8, writes the weights
where ``from_pretrained`` reads them, loads them with transformers and generates. Both
write under ``runs/``, which the repository's .gitignore ignores.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import shardfn as sf


def corpus() -> torch.Tensor:
    """Python's bundled help texts as byte tokens (vocabulary 256): nothing to download."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def global_batch(data: torch.Tensor, step: int, rows: int, seq_len: int) -> torch.Tensor:
    """Step ``step``'s batch for the whole world: the same at every world size, so a run
    resumed on another number of ranks trains on the same data."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - seq_len, (rows,), generator=gen)
    return data[starts[:, None] + torch.arange(seq_len)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="train up to this step")
    p.add_argument("--ckpt-dir", default="runs/hf-ckpt", help="sharded checkpoints; the newest there is resumed")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint interval (and after the last step)")
    p.add_argument("--export", default=None, metavar="DIR", help="at the end: save_pretrained, from_pretrained, generate")
    p.add_argument("--global-batch", type=int, default=12, help="rows per step over all ranks (12: worlds 1-4, 6)")
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()

    # torchrun --nproc-per-node N: N ranks; plain `python examples/huggingface.py`: a world of one.
    mesh = sf.Mesh.from_env()
    say = print if mesh.rank == 0 else (lambda *a: None)  # mesh.rank: this process, 0 .. mesh.size - 1
    if args.global_batch % mesh.size:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {mesh.size} ranks")

    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD")  # units: each GPT2Block, and the rest
    opt = sf.optim.adamw(3e-3)
    opt_state = opt.init(sharded)

    def loss_fn(apply, params, batch):
        # apply returns what model(...) returns, a CausalLMOutputWithCrossAttentions: with
        # labels= it holds the loss (.loss, next-token cross entropy); without, use .logits.
        return apply(params, input_ids=batch, labels=batch).loss

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)

    start = 1
    last = sf.checkpoint.latest(args.ckpt_dir)
    if last is not None:  # loads at any world size: the checkpoint holds global tensors
        sharded, opt_state, extra = sf.checkpoint.load(last, sharded, opt_state)
        start = extra["step"] + 1
        say(f"resumed from {last} at step {extra['step']} (saved by {extra['world']} ranks, now {mesh.size})")

    data, rows = corpus(), args.global_batch // mesh.size
    for n in range(start, args.steps + 1):
        batch = global_batch(data, n, args.global_batch, args.seq_len)
        mine = batch[mesh.rank * rows : (mesh.rank + 1) * rows].to(mesh.device)  # this rank's rows
        sharded, opt_state, metrics = step(sharded, opt_state, mine)
        say(f"step {n} loss {float(metrics['loss']):.6f}")  # the global mean, the same on every rank
        if n % args.save_every == 0 or n == args.steps:
            path = os.path.join(args.ckpt_dir, f"step-{n:06d}")
            sf.checkpoint.save(path, sharded, opt_state, extra={"step": n, "world": mesh.size})
            say(f"saved {path}")

    if args.export:
        sf.save_pretrained(sharded, args.export)  # every rank calls it; rank 0 writes
        if mesh.rank == 0:
            hf = GPT2LMHeadModel.from_pretrained(args.export).eval()  # plain transformers from here on
            prompt = torch.tensor([list(b"The ")])
            torch.manual_seed(0)  # the sampling's
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=True,
                              top_k=20, pad_token_id=0)
            new = out[0, prompt.shape[1]:].tolist()
            print(f"generated {len(new)} tokens: {bytes(new)!r}")  # a tiny model after a few steps: babble
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
