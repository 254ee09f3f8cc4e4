"""Train a small byte-level GPT with shardfn.

The corpus is the text that ships with Python (``pydoc_data.topics``), so the example
needs no download. Launch on N processes with torchrun, or as a plain script for one::

    torchrun --nproc-per-node 2 examples/train_lm.py --steps 50
    python examples/train_lm.py --steps 50 --strategy NO_SHARD

Every rank draws the same global batch from the same seeded generator and trains on its
own contiguous slice, so the loss curve does not depend on the world size.

Fault tolerance: with ``--ckpt-dir`` it saves a checkpoint every ``--save-every`` steps
(parameters, optimizer state, the step, the batch generator's state) and starts from the
newest one there, so torchrun can restart it after a rank dies and it continues exactly::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
        examples/train_lm.py --ckpt-dir ckpt --save-every 50

(On several machines: ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` instead of
``--standalone``. The variable gives each restart a fresh store: with the store shared,
as by default, a restarted worker can read the addresses of the workers that died and
fail to connect; see docs/checkpoints.md.)

What it leaves behind: rank 0 writes one JSON line per step to ``metrics.jsonl`` in the run
directory (``--run-dir``; default: a new ``runs/<date>-<time>``, or, when it resumes, the
directory of the run that saved the checkpoint, so a restart continues the same file):
``step``, ``loss``, ``val_loss`` (null on steps without validation), ``grad_norm``,
``tokens_per_s``, ``peak_memory_bytes`` and ``comm_bytes`` (rank 0's, that step). At the
end it draws ``loss_curves.png`` there (train and validation loss), with matplotlib
(``pip install matplotlib``, or the ``plot`` extra); without it, it says so in one line.
To draw it again from a run's ``metrics.jsonl``, without training::

    python examples/train_lm.py --plot runs/<date>-<time>/metrics.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import resource
import sys
import time

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.testing import split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIMIZER", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
VAL_BATCH = 64  # windows in the fixed validation batch
VAL_SEED_OFFSET = 1_000_003  # the val batch's generator must not replay the training draws


def load_corpus() -> bytes:
    """Returns Python's bundled pydoc topic texts as UTF-8 bytes (about 450 kB).

    Topics are joined in sorted key order so the corpus is the same on every rank.
    """
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def split_corpus(corpus: bytes, train_fraction: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits bytes into train and val token tensors (uint8), first 90% train, rest val.

    Args:
        corpus: Raw bytes; each byte is a token.
        train_fraction: Fraction of the bytes, from the start, used for training.

    Returns:
        ``(train, val)``, 1-D ``torch.uint8`` tensors.
    """
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    n = int(train_fraction * len(data))
    return data[:n], data[n:]


def get_batch(
    data: torch.Tensor, global_batch: int, seq_len: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Draws ``global_batch`` random windows of ``seq_len + 1`` tokens.

    Args:
        data: 1-D token tensor.
        global_batch: Number of windows (the batch across all ranks).
        seq_len: Tokens per input sequence.
        generator: Source of the window offsets; seed it identically on every rank.

    Returns:
        ``{"x": LongTensor[global_batch, seq_len], "y": ...}`` with ``y`` the next
        token of each position of ``x``.
    """
    n_starts = len(data) - seq_len
    if n_starts < 1:
        raise ValueError(f"data has {len(data)} tokens, too few for windows of seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(n_starts, (global_batch,), generator=generator)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return {"x": windows[:, :-1], "y": windows[:, 1:]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--strategy", default="FULL_SHARD", choices=STRATEGIES)
    p.add_argument(
        "--replicate",
        default=None,
        help="2-D mesh for the hybrid strategies: 'nodes' (one replica per torchrun node) or a number of replicas",
    )
    p.add_argument("--offload", action="store_true",
                   help="shards, gradients and optimizer state in host memory, the update on the host (docs/memory.md)")
    p.add_argument("--model", choices=("gpt", "gpt2"), default="gpt",
                   help="gpt: shardfn.testing.models.GPT; gpt2: a Hugging Face GPT-2 of the same size (needs "
                   "transformers), trained through the same code path")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="at the end, write the weights where from_pretrained reads them (shardfn.save_pretrained)")
    p.add_argument("--report-all-ranks", action="store_true", help="every rank prints its final loss")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="validation interval in steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--ckpt-dir", default=None, help="directory for checkpoints (step-NNNNNN); none: no checkpoints")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps (and after the last step)")
    p.add_argument("--run-dir", default=None,
                   help="where rank 0 writes metrics.jsonl (a JSON line per step) and loss_curves.png; default: a "
                   "new runs/<date>-<time>, or, resuming, the run directory saved in the checkpoint (a restart "
                   "continues the same metrics.jsonl)")
    p.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=True,
        help="continue from the newest checkpoint in --ckpt-dir, if there is one (default: yes, because a worker "
        "that torchrun --max-restarts restarts runs this same command line); --no-resume starts at step 1 and "
        "refuses a --ckpt-dir that already holds checkpoints, which a later resume could mistake for this run's",
    )
    p.add_argument("--progress", choices=("bar", "plain"), default="bar",
                   help="bar: a progress bar (tqdm) with loss, tokens/s, peak memory and traffic; plain: one line "
                   "per step (for logs)")
    p.add_argument("--sample-tokens", type=int, default=200, help="tokens of text generated at the end (0: none)")
    p.add_argument("--plot", default=None, metavar="METRICS",
                   help="only draw loss_curves.png beside a run's metrics.jsonl (runs/<date>-<time>/metrics.jsonl), "
                   "then exit: no training, no process group")
    p.add_argument("--final-state", default=None, help=argparse.SUPPRESS)  # tests: rank 0 torch.saves the full state
    args = p.parse_args(argv)
    if args.plot is not None and not os.path.isfile(args.plot):
        p.error(f"--plot {args.plot}: no such file (give a run's metrics.jsonl, e.g. runs/<date>-<time>/metrics.jsonl)")
    if args.replicate not in (None, "nodes"):
        args.replicate = int(args.replicate)
    if args.strategy.startswith("HYBRID") and args.replicate is None:
        p.error(f"--strategy {args.strategy} needs a 2-D mesh: pass --replicate nodes (or a number)")
    for name in ("steps", "global_batch", "seq_len", "log_every", "threads", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.model == "gpt2" and importlib.util.find_spec("transformers") is None:
        p.error("--model gpt2 needs transformers: pip install transformers (or pip install -e '.[test]')")
    if args.sample_tokens < 0:
        p.error(f"--sample-tokens must be at least 0, got {args.sample_tokens}")
    return args


def warn_if_restarts_share_the_store() -> None:
    """torchrun restarts workers on the store the dead ones used, unless told not to share it."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("RANK") == "0":
        print(f"warning: --max-restarts {restarts} with torchrun's shared store: a restarted worker may read the "
              "addresses of the dead ones and fail to connect. Launch with --standalone (or --rdzv-backend c10d) "
              "and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.", file=sys.stderr, flush=True)


def say(text: object) -> None:
    """One line in one write: lines of ranks sharing a pipe (torchrun's workers) never interleave,
    even unbuffered (``PYTHONUNBUFFERED``), where print writes the text and its newline apart."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated on the GPU, else the peak resident set (bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def peak_mib(device: torch.device) -> float:
    return peak_bytes(device) / 2**20


METRICS, CURVES = "metrics.jsonl", "loss_curves.png"


def new_run_dir(root: str = "runs") -> str:
    """``runs/<date>-<time>``, made now; ``-2``, ``-3``, ... when a run started in the same second."""
    base = os.path.join(root, time.strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 1000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: 999 runs started in this second")


class MetricsFile:
    """Rank 0's ``metrics.jsonl``: one JSON object per step, flushed as it is written (``tail -f``
    works). A run that starts at step ``start`` keeps the lines of the steps before it (those of
    the checkpoint it resumed from) and drops the rest, which it is about to redo."""

    def __init__(self, run_dir: str, start: int):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS)
        kept = [line for line in read_metrics(self.path) if line["step"] < start] if start > 1 else []
        self.file = open(self.path, "w", buffering=1, encoding="utf-8")  # line-buffered
        for line in kept:
            self.write(line)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl`` (none if there is no such file)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(run_dir: str, title: str, metrics: str | None = None) -> str:
    """Draws ``loss_curves.png`` (train and validation loss by step) from the run's
    ``metrics.jsonl`` (or the file ``metrics``, beside which it goes); returns the line to
    print: where the picture is, or how to get it."""
    metrics = metrics or os.path.join(run_dir, METRICS)
    png = os.path.join(os.path.dirname(metrics), CURVES)
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"no {CURVES}: matplotlib is not installed (pip install matplotlib, or pip install -e \".[plot]\"); "
                f"the metrics are in {metrics}")
    records = read_metrics(metrics)
    val = [r for r in records if r["val_loss"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1, label="train (the step's batch)")
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", ms=4, label="validation (fixed batch)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return f"loss curves: {png}"


class Progress:
    """Rank 0's report: a tqdm bar (``--progress bar``) or one line per step (``--progress plain``)."""

    def __init__(self, mode: str, rank: int, steps: int, start: int):
        self.on, self.bar = rank == 0, None
        if self.on and mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=start - 1, desc="train", unit="step", dynamic_ncols=True)

    def step(self, n: int, loss: float, tokens_per_s: float, peak: float, comm: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  peak {peak:.0f} MiB/rank  "
                                     f"comm {comm:.1f} MiB/step", refresh=False)
            self.bar.update(1)
        elif self.on:
            say(f"step {n} loss {loss:.4f}  tokens/s {tokens_per_s:.0f}")

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.on:
            say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def sample(apply, logits_of, sharded, prompt: bytes, n: int, seq_len: int, device: torch.device, seed: int,
           top_k: int = 10, temperature: float = 0.8) -> bytes:
    """``n`` bytes after ``prompt``, drawn from the ``top_k`` most likely at ``temperature``,
    on the shards. Every rank calls it (each forward gathers the units) and draws from a
    generator seeded alike, so every rank feeds the model the same text."""
    x = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    gen = torch.Generator().manual_seed(seed)
    apply.eval()
    try:
        with torch.no_grad():
            for _ in range(n):
                logits = logits_of(sharded, x[:, -seq_len:])[0, -1].float().cpu() / temperature
                top = logits.topk(top_k)
                choice = top.indices[torch.multinomial(top.values.softmax(-1), 1, generator=gen)]
                x = torch.cat([x, choice.view(1, 1).to(device)], dim=1)
    finally:
        apply.train()
    return bytes(x[0, len(prompt):].tolist())


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model to train: a byte-level LM of ``--d-model`` x ``--layers``, shardfn's GPT or
    a Hugging Face GPT-2 of the same shape (no dropout), seeded by the caller."""
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.d_model, n_layer=args.layers,
                            n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                            eos_token_id=0, use_cache=False)
        return GPT2LMHeadModel(config)
    return GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads))


def die_if_told(n: int, mesh: sf.Mesh) -> None:
    """For tests of fault tolerance: the last rank SIGKILLs itself before step
    ``SHARDFN_EXAMPLE_KILL_AT_STEP``, in torchrun's first attempt only."""
    kill_at = int(os.environ.get("SHARDFN_EXAMPLE_KILL_AT_STEP", "0"))
    if n == kill_at and mesh.rank == mesh.size - 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot is not None:  # draw a finished (or running) run's curves again, nothing else
        line = plot_losses(os.path.dirname(args.plot), f"examples/train_lm.py: {args.plot}", args.plot)
        if not line.startswith("loss curves: "):
            sys.exit(line)  # no matplotlib: the line says how to get it, and the exit status that nothing was drawn
        say(line)
        return
    torch.set_num_threads(args.threads)
    warn_if_restarts_share_the_store()
    mesh = sf.Mesh.from_env(replicate=args.replicate)
    try:
        train(args, mesh)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, mesh: sf.Mesh) -> None:
    """The training loop; ``mesh`` is already initialised."""
    if args.global_batch % mesh.size:
        raise ValueError(
            f"--global-batch {args.global_batch} is not divisible by world size {mesh.size}; "
            f"use a multiple of {mesh.size}"
        )
    log = say if mesh.rank == 0 else (lambda text: None)

    train_data, val_data = split_corpus(load_corpus())
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())

    params, apply = sf.functionalize(model)
    offload = sf.Offload(params=True, optimizer=True) if args.offload else None
    sharded = sf.shard(params, mesh, args.strategy, offload=offload)
    opt = sf.optim.adamw(args.lr, weight_decay=0.1)
    opt_state = opt.init(sharded)

    def logits(params, x):
        out = apply(params, x)
        return out.logits if args.model == "gpt2" else out

    def loss_fn(apply, params, batch):
        return lm_loss(logits(params, batch["x"]), batch["y"])

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)

    def to_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(mesh.device) for k, v in batch.items()}

    # Every rank evaluates the same full val batch, so each gets the same loss and no
    # reduction is needed; apply still gathers the shards, so all ranks must call it.
    val_gen = torch.Generator().manual_seed(args.seed + VAL_SEED_OFFSET)
    val_batch = to_device(get_batch(val_data, VAL_BATCH, args.seq_len, val_gen))

    def val_loss() -> float:
        # Validation runs in eval mode, as model.eval() would: this GPT has no dropout or
        # batch statistics, so the loss is the same, but a model with them needs it (in
        # train mode apply would also update the tree's running statistics).
        apply.eval()
        try:
            with torch.no_grad():
                return lm_loss(logits(sharded, val_batch["x"]), val_batch["y"]).item()
        finally:
            apply.train()

    log(f"world size {mesh.size}  strategy {args.strategy}  parameters {n_params:,}  device {mesh.device}")
    log(sharded.layout)
    t_start, trained_tokens, comm = time.perf_counter(), 0, float("nan")

    gen = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.global_batch * args.seq_len
    first = loss = float("nan")
    start, saved_run_dir = 1, None
    resume_from = sf.checkpoint.latest(args.ckpt_dir) if args.ckpt_dir else None
    if resume_from and not args.resume:
        raise ValueError(f"--no-resume, but --ckpt-dir {args.ckpt_dir} holds checkpoints ({resume_from}); "
                         "pass an empty directory, or drop --no-resume to continue from it")
    if resume_from:
        sharded, opt_state, extra = sf.checkpoint.load(resume_from, sharded, opt_state)
        gen.set_state(extra["data_rng"])
        torch.set_rng_state(extra["torch_rng"])
        start, first, loss = extra["step"] + 1, extra["first_loss"], extra["loss"]
        saved_run_dir = extra.get("run_dir")  # checkpoints from before metrics.jsonl have none
        log(f"resumed from {resume_from} at step {extra['step']}")
    # Every rank takes the same branch (same arguments, same checkpoint): rank 0 names a new
    # directory and tells the others, who save its name in the checkpoints for a restart.
    run_dir = args.run_dir or saved_run_dir or mesh.broadcast(new_run_dir() if mesh.rank == 0 else None)
    run_log = None
    if mesh.rank == 0:
        run_log = MetricsFile(run_dir, start)
        log(f"metrics: {run_log.path} (a JSON line per step)")
    progress = Progress(args.progress, mesh.rank, args.steps, start)
    v = float("nan")
    for n in range(start, args.steps + 1):
        die_if_told(n, mesh)
        global_batch = get_batch(train_data, args.global_batch, args.seq_len, gen)
        batch = to_device(split_batch(global_batch, mesh.rank, mesh.size))
        t0 = time.perf_counter()
        sharded, opt_state, metrics = step(sharded, opt_state, batch)
        loss = float(metrics["loss"])  # a python float: the step has finished on the device
        dt = time.perf_counter() - t0
        if n == 1:
            first = loss
        trained_tokens += tokens_per_step
        comm_bytes = sum(metrics["comm_bytes"].values())
        comm = comm_bytes / 2**20
        progress.step(n, loss, tokens_per_step / dt, peak_mib(mesh.device), comm)
        validated = n % args.log_every == 0 or n == args.steps
        if validated:
            v = val_loss()
            progress.write(f"val loss {v:.4f} at step {n}")
        if run_log is not None:
            run_log.write({"step": n, "loss": loss, "val_loss": v if validated else None,
                           "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_step / dt,
                           "peak_memory_bytes": peak_bytes(mesh.device), "comm_bytes": comm_bytes})
        if args.ckpt_dir and (n % args.save_every == 0 or n == args.steps):
            # Everything the loop needs to go on exactly: the step, the data generator (and
            # torch's global generator, for a model with dropout), the losses it reports.
            extra = {"step": n, "first_loss": first, "loss": loss, "data_rng": gen.get_state(),
                     "torch_rng": torch.get_rng_state(), "run_dir": run_dir}
            sf.checkpoint.save(os.path.join(args.ckpt_dir, f"step-{n:06d}"), sharded, opt_state, extra=extra)
    progress.close()
    seconds = time.perf_counter() - t_start
    peak = mesh.reduce(torch.tensor(peak_mib(mesh.device)), "max").item()  # the largest rank's
    if args.sample_tokens:
        prompt = b"The "
        text = sample(apply, logits, sharded, prompt, args.sample_tokens, args.seq_len, mesh.device, args.seed)
        log("sample: " + (prompt + text).decode("utf-8", errors="replace"))
    checkpoint = sf.checkpoint.latest(args.ckpt_dir) if args.ckpt_dir else None
    log(f"summary: {args.steps - start + 1} steps in {seconds:.1f} s ({trained_tokens / seconds:,.0f} tokens/s), "
        f"train loss {loss:.4f}, val loss {v:.4f}, peak {peak:.0f} MiB per rank "
        f"({'allocated on the GPU' if mesh.device.type == 'cuda' else 'resident set'}), "
        f"{comm:.2f} MiB communicated per rank and step, checkpoint {checkpoint or 'none (--ckpt-dir)'}")
    log(f"final loss {loss:.4f} (first {first:.4f})")
    if run_log is not None:
        run_log.close()
        log(plot_losses(run_dir, f"examples/train_lm.py: {args.model}, {args.strategy}, {mesh.size} ranks"))
    if args.report_all_ranks:
        say(f"rank {dist.get_rank()} final loss {loss!r}")
    if args.export:
        files = sf.save_pretrained(sharded, args.export)
        log(f"exported to {args.export} ({', '.join(files)})")
    if args.final_state:
        full = sf.gather(sharded, rank0_only=True, device="cpu")
        if mesh.rank == 0:
            torch.save(full, args.final_state)


if __name__ == "__main__":
    main()
    # After gloo, the interpreter's own shutdown sometimes aborts ("terminate called without an
    # active exception", SIGABRT; 1 run in 12 here), which torchrun counts as a failed worker and,
    # with --max-restarts, restarts. The work is done and the group destroyed: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
