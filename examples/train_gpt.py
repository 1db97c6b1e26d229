"""Train a small GPT on a dp x tp device mesh with dtorch, from one ordinary PyTorch program.

A byte-level GPT (vocabulary of 256 byte values) learns ``examples/data/corpus.txt`` (public
domain texts, see examples/data/README.md). By default it runs on four devices as a 2x2 mesh:
tensor parallel over "tp" (``dt.nn.parallelize_module``: colwise q/k/v, MLP fc and LM head,
rowwise attention and MLP projections, vocabulary-sharded token embedding) and data parallel
over "dp" (``dt.nn.data_parallel``). The optimizer is plain ``torch.optim.AdamW``. With
``--device-count 1`` the same code trains on plain torch in this process: the reference whose
losses the distributed run matches within float32 tolerance (same seed, same data order).

    pip install -e '.[examples]'                      # tqdm and matplotlib
    python examples/train_gpt.py                      # 2x2 mesh, thread runner, 300 steps, loss.png
    python examples/train_gpt.py --runner process     # worker processes instead of threads
    python examples/train_gpt.py --device-count 1     # plain torch, one device: the reference
    python examples/train_gpt.py --ckpt-every 100     # sharded checkpoints in checkpoints/train_gpt/
    python examples/train_gpt.py --resume --steps 600 # continue from the latest one

With the process runner, each worker runs ``cores / devices`` intra-op threads by default; for a
model this small one thread per worker is several times faster on a many-core host
(``DTORCH_WORKER_THREADS=1``: 7.7k instead of 2.0k tokens/s on 16 cores).

The functions are importable (tests/test_train_gpt_example.py and bench/train_gpt.py use them):
``train(parse_args([...]))`` returns the loss of every step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import sys
import time
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import nn

import dtorch_core as dt

log = structlog.get_logger("train_gpt")

DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
VOCAB = 256  # byte-level tokens: any text file works, and 256 splits evenly over tp = 2, 4, 8
CKPT_NAME = re.compile(r"step-(\d+)$")  # published checkpoints only (never a save in progress)


# ---------------------------------------------------------------------------------------------
# the model: an ordinary torch module, written once for every device count
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``heads`` and the MLP width must divide by tp for an even split (uneven
    splits work too, but cost redistributions)."""

    vocab: int = VOCAB
    seq_len: int = 128
    d_model: int = 128
    heads: int = 4
    layers: int = 4

    @property
    def ff(self) -> int:
        return 4 * self.d_model


class Attention(nn.Module):
    """Causal self-attention. q, k and v are three Linears rather than one fused ``qkv``: sharding
    a fused output column-wise would put q, k and v columns of different heads on one rank."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: the same code sees all heads (dtorch, global view) or a rank's heads (torch TP)
        q, k, v = (lin(x).view(b, s, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff)
        self.proj = nn.Linear(cfg.ff, cfg.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder: token and learned position embeddings, pre-norm blocks, LM head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down by depth, so the residual stream stays O(1)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tp_plan() -> dict:
    """The tensor-parallel plan over mesh["tp"] (names as in torch.distributed.tensor.parallel).

    The LM head keeps its logits sharded over the vocabulary: cross entropy reduces across the
    shards instead of gathering the (batch, seq, vocab) logits.
    """
    col, row = dt.nn.ColwiseParallel, dt.nn.RowwiseParallel
    return {
        "tok_emb": row(),  # vocabulary-sharded table; lookups are all-reduced
        "blocks.*.attn.q": col(),
        "blocks.*.attn.k": col(),
        "blocks.*.attn.v": col(),
        "blocks.*.attn.proj": row(),
        "blocks.*.mlp.fc": col(),
        "blocks.*.mlp.proj": row(),
        "head": col(output_layouts=dt.Shard(-1)),
    }


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The model with the initial weights of ``seed`` (the same on every device count)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def distribute(model: GPT, mesh) -> GPT:
    """Tensor parallel over mesh["tp"], data parallel over mesh["dp"] (in place)."""
    model = dt.nn.parallelize_module(model, mesh["tp"], tp_plan())
    model = dt.nn.data_parallel(model, mesh["dp"])
    return model


def make_optimizer(model: nn.Module, lr: float, *, replayable: bool = False) -> torch.optim.Optimizer:
    """AdamW; ``replayable``: dtorch's, whose step count lives on the workers (dt.compile needs it)."""
    adamw = dt.optim.AdamW if replayable else torch.optim.AdamW
    return adamw(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def make_step(model: nn.Module, opt: torch.optim.Optimizer, mesh=None, *, compile: bool = False):
    """``step(tokens, targets) -> loss``: ``train_step`` on this model, captured once and replayed
    from one message per call with ``compile`` (the batch is then distributed before the call:
    a captured step takes distributed tensors)."""
    if not compile or mesh is None:
        return lambda tokens, targets: train_step(model, opt, tokens, targets)
    compiled = dt.compile(train_step)
    batch = [dt.Shard(0), dt.Replicate()]  # rows over "dp", whole on "tp"

    def step(tokens, targets):
        return compiled(model, opt, dt.distribute_tensor(tokens, mesh, batch),
                        dt.distribute_tensor(targets, mesh, batch))

    return step


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tokens, targets):
    """One optimizer step; returns the loss without reading it (reading waits for the workers)."""
    opt.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    return loss


# ---------------------------------------------------------------------------------------------
# data: deterministic from (seed, step), so a resumed run sees the batches it would have seen
# ---------------------------------------------------------------------------------------------
def load_corpus(path: str | os.PathLike = DATA) -> torch.Tensor:
    """The file's bytes as a 1-D int64 tensor of token ids."""
    raw = Path(path).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def get_batch(data: torch.Tensor, step: int, batch: int, seq_len: int, seed: int):
    """(tokens, targets) of shape (batch, seq_len) at random offsets drawn from ``(seed, step)``."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"the corpus has {data.numel()} tokens; it needs more than seq_len + 1 = {seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=g)
    index = starts[:, None] + torch.arange(seq_len + 1)
    window = data[index]
    return window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------------------------
# checkpoints (dt.checkpoint, imported only when asked for)
# ---------------------------------------------------------------------------------------------
def checkpoint_api():
    """``dtorch_core.checkpoint`` with ``save``/``load``, or a clear error if this dtorch lacks it."""
    try:
        from dtorch_core import checkpoint
    except ImportError as err:
        raise SystemExit(
            f"checkpointing (--ckpt-every / --resume) needs dtorch_core.checkpoint, which this "
            f"dtorch-core does not provide ({err}); run without those options"
        ) from None
    if not (hasattr(checkpoint, "save") and hasattr(checkpoint, "load")):
        raise SystemExit("checkpointing needs dtorch_core.checkpoint.save/load, which this dtorch-core lacks")
    return checkpoint


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The published ``step-N`` directory with the largest N, or None."""
    found = [(int(m.group(1)), p) for p in Path(ckpt_dir).glob("step-*") if (m := CKPT_NAME.match(p.name))]
    return max(found)[1] if found else None


# ---------------------------------------------------------------------------------------------
# the training loop
# ---------------------------------------------------------------------------------------------
def _value(loss) -> float:
    return loss.full_tensor().item() if isinstance(loss, dt.DTensor) else loss.item()


class LossReader:
    """Reads each step's loss ``lag`` steps after the step was issued.

    A read waits for the devices to reach that loss: reading the newest one waits for every step
    issued, so the devices run dry and the bar stalls for as long as the queued steps take. A
    loss ``lag`` steps old is (nearly) ready while later steps keep the devices busy; one such
    read per step keeps the controller ``lag`` steps ahead and the bar at the devices' pace.
    """

    def __init__(self, lag: int, values: list[float] | None = None):
        self.lag, self._pending = max(0, lag), collections.deque()
        self.values = [] if values is None else values  # every loss read, from step 0

    def push(self, loss) -> None:
        """Keep this step's loss handle; read those now ``lag`` steps old."""
        self._pending.append(loss)
        while len(self._pending) > self.lag:
            self.values.append(_value(self._pending.popleft()))

    def drain(self) -> list[float]:
        """Read every loss still pending (before a checkpoint and at the end)."""
        while self._pending:
            self.values.append(_value(self._pending.popleft()))
        return self.values


def _progress(iterable, enabled: bool, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety: train without it
        if enabled:
            log.warning("tqdm is not installed (pip install -e '.[examples]'); no progress bar")
        return _NoBar(iterable)
    return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kwargs)


class _NoBar:
    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **kwargs):
        pass

    close = set_postfix


def config_from(args) -> GPTConfig:
    return GPTConfig(seq_len=args.seq_len, d_model=args.d_model, heads=args.heads, layers=args.layers)


def device_count(args) -> int:
    return args.device_count if args.device_count is not None else args.dp * args.tp


def train(args) -> list[float]:
    """Train as ``args`` says (see :func:`parse_args`); returns the loss of every step from 0.

    With more than one device it uses the running dtorch session if there is one (its runner
    and world size) and otherwise starts one (and stops it at the end). A resumed run returns
    the losses saved in the checkpoint followed by the new ones.
    """
    cfg = config_from(args)
    n_dev = device_count(args)
    data = load_corpus(args.data)
    started_session = False
    try:
        if n_dev > 1:
            if n_dev != args.dp * args.tp:
                raise SystemExit(f"--device-count {n_dev} but --dp {args.dp} x --tp {args.tp} = {args.dp * args.tp}")
            if not dt.is_initialized():
                dt.init(world_size=n_dev, runner=args.runner, device_type=args.device_type or "cpu")
                started_session = True
            # a running session (e.g. a test's) decides the device type
            mesh = dt.init_device_mesh(dt.device_type(), (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
            dt.manual_seed(args.seed)
            model = distribute(build_model(cfg, args.seed), mesh)
            where = f"{args.dp}x{args.tp} mesh (dp x tp)" + (", compiled" if args.compile else "")
        else:
            mesh = None
            model = build_model(cfg, args.seed)
            where = "1 device (plain torch)"
        opt = make_optimizer(model, args.lr, replayable=args.compile and mesh is not None)
        step_fn = make_step(model, opt, mesh, compile=args.compile)
        n_params = sum(p.numel() for p in model.parameters())
        log.info("model", params=n_params, layers=cfg.layers, d_model=cfg.d_model, heads=cfg.heads,
                 seq_len=cfg.seq_len, batch=args.batch, on=where, corpus_bytes=data.numel())

        start, losses = 0, []
        if args.resume:
            path = Path(args.resume) if args.resume != "latest" else latest_checkpoint(args.ckpt_dir)
            if path is None:
                raise SystemExit(f"--resume: no checkpoint (step-N directory) in {args.ckpt_dir}")
            extra = checkpoint_api().load(model, opt, str(path))
            start, losses = int(extra["step"]), [float(v) for v in extra["losses"]]
            log.info("resumed", checkpoint=str(path), step=start)
        if args.ckpt_every:
            checkpoint_api()  # fail before training, not at the first save

        bar = _progress(range(start, args.steps), args.progress, initial=start, total=args.steps,
                        desc="train", unit="step")
        reader = LossReader(args.loss_lag, losses)
        t0 = time.perf_counter()
        try:
            for step in bar:
                tokens, targets = get_batch(data, step, args.batch, cfg.seq_len, args.seed)
                known = len(losses)
                reader.push(step_fn(tokens, targets).detach())
                last = step + 1 == args.steps
                save = bool(args.ckpt_every) and ((step + 1) % args.ckpt_every == 0 or last)
                if save or last:
                    reader.drain()
                if len(losses) > known:  # the newest loss read is step len(losses)'s
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
                    if last or len(losses) // args.log_every > known // args.log_every:
                        log.info("step", step=len(losses), loss=round(losses[-1], 5))
                if save:
                    path = Path(args.ckpt_dir) / f"step-{step + 1:06d}"
                    checkpoint_api().save(model, opt, str(path), extra={"step": step + 1, "losses": losses})
        finally:
            bar.close()
        elapsed = time.perf_counter() - t0
        done = args.steps - start
        if done:
            log.info("done", steps=done, seconds=round(elapsed, 2),
                     tokens_per_s=round(done * args.batch * cfg.seq_len / max(elapsed, 1e-9)))
    finally:
        if started_session:
            dt.shutdown()
    if args.plot and losses:
        plot_losses(losses, args.plot, title=f"byte-level GPT on {Path(args.data).name}, {where}")
        log.info("plot written", path=args.plot)
    return losses


def plot_losses(losses: list[float], path: str | os.PathLike, title: str = "") -> None:
    """Write the loss curve to ``path`` (PNG) with matplotlib's Agg backend."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[examples]' (or pass --plot '')") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2, help="data-parallel size (mesh dim 'dp'; default %(default)s)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (mesh dim 'tp'; default %(default)s)")
    p.add_argument("--device-count", type=int, default=None,
                   help="devices (default dp x tp); 1 trains on plain torch in this process (the reference)")
    p.add_argument("--runner", default=None,
                   help="dtorch runner: inline, thread, process, ... (default $DTORCH_RUNNER or thread)")
    p.add_argument("--device-type", default=None,
                   help="device type of the workers: cpu, or cuda with the dtorch_nccl plugin (default cpu)")
    p.add_argument("--steps", type=int, default=300,
                   help="train until this step; a resumed run continues to it (default %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step, split over dp (default %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default %(default)s)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="capture the training step once and replay it (dt.compile, with dtorch's AdamW)")
    p.add_argument("--data", default=str(DATA), help="training text, read as bytes (default: the shipped corpus)")
    p.add_argument("--ckpt-dir", default="checkpoints/train_gpt",
                   help="where step-N checkpoints go (default %(default)s)")
    p.add_argument("--ckpt-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps and at the end (default 0: never)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from a checkpoint: the latest in --ckpt-dir, or PATH")
    p.add_argument("--plot", default="loss.png",
                   help="PNG of the loss curve, written at the end; '' for none (default %(default)s)")
    p.add_argument("--log-every", type=int, default=10, metavar="N", help="log the loss every N steps (default %(default)s)")
    p.add_argument("--loss-lag", type=int, default=2, metavar="K",
                   help="read each step's loss K steps late, so that a read never waits for the steps queued "
                        "behind it; 0 reads it at once and lets the devices run dry (default %(default)s)")
    p.add_argument("--log-level", default="info",
                   help="structlog level; debug shows dtorch's own records (default %(default)s)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show a tqdm progress bar (default: shown)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command-line options as a Namespace (``parse_args([])`` gives the defaults)."""
    return build_parser().parse_args(argv)


class _TqdmStream:
    """Log records through ``tqdm.write`` so they do not tear the progress bar."""

    def write(self, text: str) -> int:
        try:
            from tqdm import tqdm
        except ImportError:
            return sys.stderr.write(text)
        text = text.rstrip("\n")
        if text:
            tqdm.write(text, file=sys.stderr)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def main(argv=None) -> int:
    args = parse_args(argv)
    from dtorch_core.logging import configure

    configure(args.log_level, stream=_TqdmStream())
    losses = train(args)
    if losses:
        print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f} after {len(losses)} steps"
              + (f"; curve in {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
