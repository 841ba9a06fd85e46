"""Workloads: a model, its data and its loss, as the rest of autotune consumes them.

A :class:`Workload` is everything a probe, a benchmark or a test needs to run training
steps of a model on any rank: the model, a ``make_batch(step)`` that yields the calling
rank's batch, and a loss. Five built-ins cover the cases the tuner must get right:

- :func:`mlp`: a few hundred thousand parameters, fast; for unit tests.
- :func:`cnn`: a ResNet-like CNN with ~9 M parameters, most of them in a few large late
  tensors; compute- and bandwidth-heavy, where compressing the large layers pays.
- :func:`transformer`: a small GPT-style decoder with many small tensors, where bucketing
  and per-collective latency matter more than bandwidth.
- :func:`dlrm`: a DLRM-style recommendation model whose parameters are nearly all in a
  few large embedding tables (~56 MB of gradient per step, mostly zero rows), where a
  slow link is the bottleneck and large tensors must be priced without being copied
  over and over.
- :func:`digits`: scikit-learn's bundled digits set with a held-out test split, for
  checking that a policy still converges (``evaluate`` returns test accuracy).

User workloads are functions with no required arguments that return a :class:`Workload`;
:func:`resolve_workload` finds one from ``name``, ``path/to/file.py:function`` or
``package.module:function``.

Determinism: every model is built under a fixed seed (without touching the caller's
global RNG), so all ranks build identical models; ``make_batch(step)`` draws from a
generator seeded by ``(seed, step, rank)``, so a run is reproducible and ranks see
different data. The built-ins' ``make_batch`` also takes keyword-only ``rank`` and
``world_size``, to draw another rank's batch without a process group (tests, simulation).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autotune.errors import WorkloadError

__all__ = [
    "Workload",
    "BUILTINS",
    "mlp",
    "cnn",
    "transformer",
    "dlrm",
    "digits",
    "resolve_workload",
    "describe",
]

# (inputs, targets). inputs is what the model's forward takes as its one argument: a
# tensor for most models, a (dense, sparse) pair of tensors for dlrm.
Batch = tuple[Any, Tensor]


@dataclass(frozen=True, eq=False)
class Workload:
    """A model, the data it trains on, and its loss.

    Attributes:
        model: the module to train; identical on every rank.
        make_batch: ``make_batch(step) -> (inputs, targets)`` for the calling rank;
            ``inputs`` is passed to the model as its one argument (a tensor, or a tuple
            or dict of tensors, which DDP and the probes move to the device). It must be
            deterministic given ``(step, rank)`` and differ between ranks, so
            that runs are reproducible and data-parallel ranks see different samples.
        loss_fn: ``loss_fn(model(inputs), targets)`` returns a scalar tensor.
        name: a short label used in profiles, policies and reports.
        evaluate: optional ``evaluate(model) -> float``, a held-out score in [0, 1],
            higher is better (accuracy; ROC AUC for dlrm); convergence checks compare it
            between policies.
    """

    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    name: str = "custom"
    evaluate: Callable[[nn.Module], float] | None = None

    def __post_init__(self) -> None:
        # Checked here, where the workload is built, not deep inside a training step.
        if not isinstance(self.model, nn.Module):
            raise WorkloadError(
                f"Workload.model must be a torch.nn.Module, got {type(self.model).__name__}"
            )
        for field_name in ("make_batch", "loss_fn"):
            if not callable(getattr(self, field_name)):
                raise WorkloadError(f"Workload.{field_name} must be callable")
        if self.evaluate is not None and not callable(self.evaluate):
            raise WorkloadError("Workload.evaluate must be callable or None")
        if not isinstance(self.name, str) or not self.name:
            raise WorkloadError(f"Workload.name must be a non-empty str, got {self.name!r}")


# ---------------------------------------------------------------------------------------
# Helpers shared by the built-ins


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The calling rank and world size: explicit values win, then the process group."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size={world_size}), got {rank}; outside a process "
            "group, pass world_size together with rank"
        )
    return rank, world_size


# Streams keep training batches and held-out evaluation data from ever sharing a seed.
_TRAIN, _EVAL, _TEACHER = 0, 1, 2


def _generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by a well-mixed hash of non-negative integer keys."""
    for k in keys:
        if k < 0:
            raise ValueError(f"seeds, steps and ranks must be >= 0, got {k}")
    seed = int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator().manual_seed(seed)


def _build(seed: int, factory: Callable[[], nn.Module]) -> nn.Module:
    """Build a module under ``seed`` without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def _accuracy(model: nn.Module, inputs: Tensor, targets: Tensor, chunk: int = 512) -> float:
    """Top-1 accuracy, in eval mode and without gradients; restores the module's mode."""
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for i in range(0, len(inputs), chunk):
                logits = model(inputs[i : i + chunk])
                pred = logits.argmax(dim=-1)
                correct += int((pred == targets[i : i + chunk]).sum())
    finally:
        model.train(was_training)
    return correct / targets.numel()


# ---------------------------------------------------------------------------------------
# mlp


def _mlp_net(in_features: int, hidden: int, depth: int, out_features: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


def mlp(
    *,
    in_features: int = 32,
    hidden: int = 256,
    depth: int = 4,
    num_classes: int = 10,
    batch_size: int = 64,
    seed: int = 0,
) -> Workload:
    """A small MLP classifying synthetic data labelled by a fixed random teacher.

    With the defaults: 5 Linear layers, ~208 k parameters, 10 tensors; a step takes a
    few milliseconds on one core.

    Args:
        in_features: input dimension.
        hidden: width of every hidden layer; parameters grow with its square.
        depth: number of hidden layers (the model has ``depth + 1`` Linear layers).
        num_classes: number of classes the teacher assigns.
        batch_size: samples per rank and step.
        seed: seeds the model, the teacher and the data.

    Returns:
        The workload; ``evaluate`` gives accuracy on 2048 held-out samples.
    """
    model = _build(seed, lambda: _mlp_net(in_features, hidden, depth, num_classes))
    # A linear teacher makes the labels learnable; a fixed stream keeps it rank-independent.
    teacher = torch.randn(in_features, num_classes, generator=_generator(seed, _TEACHER))

    def sample(gen: torch.Generator, n: int) -> Batch:
        x = torch.randn(n, in_features, generator=gen)
        return x, (x @ teacher).argmax(dim=1)

    def make_batch(step: int, *, rank: int | None = None, world_size: int | None = None) -> Batch:
        r, _ = _rank_world(rank, world_size)
        return sample(_generator(seed, _TRAIN, step, r), batch_size)

    test_x, test_y = sample(_generator(seed, _EVAL), 2048)
    return Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=F.cross_entropy,
        name="mlp",
        evaluate=lambda m: _accuracy(m, test_x, test_y),
    )


# ---------------------------------------------------------------------------------------
# cnn


class _BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class _ResNet(nn.Module):
    """A stem, one stage per width (each after the first halves the resolution), a head."""

    def __init__(self, widths: tuple[int, ...], blocks: tuple[int, ...], num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        stages: list[nn.Module] = []
        cin = widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks)):
            stage = [_BasicBlock(cin, width, 1 if i == 0 else 2)]
            stage += [_BasicBlock(width, width, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*stage))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def cnn(
    *,
    widths: tuple[int, ...] = (16, 32, 64, 256, 512),
    blocks: tuple[int, ...] = (1, 1, 1, 1, 2),
    num_classes: int = 10,
    batch_size: int = 16,
    noise: float = 4.0,
    seed: int = 0,
) -> Workload:
    """A ResNet-like CNN on synthetic 32x32 RGB images of 10 classes.

    The stages run at 32, 16, 8, 4 and 2 pixels and most parameters sit in the last two,
    low-resolution stages: with the defaults the model has ~9.2 M parameters in 53 tensors
    (the four 3x3 convolutions of the 512-channel stage hold 89% of them), while a training step
    (forward, backward, SGD) takes about 170-190 ms on one CPU core. To tune it: step
    time is roughly linear in ``batch_size``; each million parameters in the 2x2 stage
    costs about 12 ms per step at batch 16, a million at 4x4 about twice that, and the
    early, wide-resolution stages cost time but almost no parameters.

    Each image is a smooth class template plus Gaussian pixel noise; at ``noise=4``
    SGD (lr 0.02, momentum 0.9) gets to ~80% held-out accuracy in a few dozen steps,
    so compression that harms convergence shows.

    Args:
        widths: channels of each stage; the first runs at full resolution.
        blocks: basic blocks per stage; same length as ``widths``.
        num_classes: number of image classes.
        batch_size: images per rank and step.
        noise: standard deviation of the pixel noise added to each class's template;
            larger is harder (1 is learnt in a few steps, 8 barely in a hundred).
        seed: seeds the model, the class templates and the data.

    Returns:
        The workload; ``evaluate`` gives accuracy on 256 held-out images.

    Raises:
        WorkloadError: ``widths`` and ``blocks`` differ in length or are empty.
    """
    if not widths or len(widths) != len(blocks) or min(blocks) < 1:
        raise WorkloadError(
            "cnn needs one block count >= 1 per stage width; "
            f"got widths={widths} and blocks={blocks}"
        )
    widths, blocks = tuple(widths), tuple(blocks)
    model = _build(seed, lambda: _ResNet(widths, blocks, num_classes))
    # Smooth per-class templates (8x8 upsampled) make images learnable but not trivial.
    coarse = torch.randn(num_classes, 3, 8, 8, generator=_generator(seed, _TEACHER))
    templates = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)

    def sample(gen: torch.Generator, n: int) -> Batch:
        y = torch.randint(num_classes, (n,), generator=gen)
        x = templates[y] + noise * torch.randn(n, 3, 32, 32, generator=gen)
        return x, y

    def make_batch(step: int, *, rank: int | None = None, world_size: int | None = None) -> Batch:
        r, _ = _rank_world(rank, world_size)
        return sample(_generator(seed, _TRAIN, step, r), batch_size)

    test_x, test_y = sample(_generator(seed, _EVAL), 256)
    return Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=F.cross_entropy,
        name="cnn",
        evaluate=lambda m: _accuracy(m, test_x, test_y, chunk=128),
    )


# ---------------------------------------------------------------------------------------
# transformer


class _Block(nn.Module):
    """Pre-norm decoder block: LN -> causal self-attention -> LN -> MLP, both residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _GPT(nn.Module):
    """Token and position embeddings, decoder blocks, a final LayerNorm, an LM head."""

    def __init__(
        self, vocab: int, seq_len: int, dim: int, layers: int, heads: int, tie: bool
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.Sequential(*[_Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            # One tensor under two modules: named_parameters() and DDP see it once, as
            # "tok.weight", so a policy must key it by that name.
            self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(pos))
        return self.head(self.ln_f(x))


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def transformer(
    *,
    vocab: int = 64,
    seq_len: int = 64,
    dim: int = 128,
    layers: int = 4,
    heads: int = 4,
    tie_weights: bool = False,
    period: int = 8,
    batch_size: int = 8,
    seed: int = 0,
) -> Workload:
    """A small GPT-style decoder learning to continue repeating token sequences.

    Each sequence repeats a random motif of ``period`` tokens; after the first motif every
    next token is the one ``period`` positions back, which attention learns (SGD with lr
    0.1 and momentum 0.9 reaches ~100% held-out accuracy in about 200 steps), so the loss
    falls from ``log(vocab)`` towards ``(period - 1) / seq_len * log(vocab)``. With the
    defaults: ~0.82 M parameters in 53 tensors (12 per block), most of them small; about
    60-75 ms per step on one core.

    Args:
        vocab: vocabulary size (also the modulus of the sequences).
        seq_len: tokens per sequence, the context length.
        dim: model width; must be divisible by ``heads``.
        layers: decoder blocks; each adds 12 parameter tensors.
        heads: attention heads.
        tie_weights: share the token embedding with the LM head (one tensor fewer).
        period: length of the repeated motif; at most ``seq_len``.
        batch_size: sequences per rank and step.
        seed: seeds the model and the data.

    Returns:
        The workload; ``evaluate`` gives next-token accuracy on the predictable
        positions (after the first motif) of 256 held-out sequences.

    Raises:
        WorkloadError: ``dim`` is not divisible by ``heads``, or ``period`` is not in
            [1, ``seq_len``].
    """
    if dim % heads:
        raise WorkloadError(f"transformer needs dim divisible by heads, got {dim} and {heads}")
    if not 1 <= period <= seq_len:
        raise WorkloadError(f"transformer needs 1 <= period <= seq_len ({seq_len}), got {period}")
    model = _build(seed, lambda: _GPT(vocab, seq_len, dim, layers, heads, tie_weights))

    def sample(gen: torch.Generator, n: int) -> Batch:
        motif = torch.randint(vocab, (n, period), generator=gen)
        seq = motif.repeat(1, seq_len // period + 2)[:, : seq_len + 1]
        return seq[:, :-1], seq[:, 1:]

    def make_batch(step: int, *, rank: int | None = None, world_size: int | None = None) -> Batch:
        r, _ = _rank_world(rank, world_size)
        return sample(_generator(seed, _TRAIN, step, r), batch_size)

    test_x, test_y = sample(_generator(seed, _EVAL), 256)

    def evaluate(m: nn.Module) -> float:
        # Targets before the first repeat are random and cannot be predicted.
        was_training = m.training
        m.eval()
        try:
            with torch.no_grad():
                pred = m(test_x).argmax(dim=-1)
        finally:
            m.train(was_training)
        return float((pred[:, period - 1 :] == test_y[:, period - 1 :]).float().mean())

    return Workload(
        model=model, make_batch=make_batch, loss_fn=_lm_loss, name="transformer",
        evaluate=evaluate,
    )


# ---------------------------------------------------------------------------------------
# dlrm


class _DLRM(nn.Module):
    """DLRM (Naumov et al. 2019) with mixed-dimension tables (Ginart et al. 2021).

    Dense features go through the bottom MLP; each categorical feature is a bag of rows
    summed from its table (``EmbeddingBag(mode="sum")``, dense gradients, as DDP with
    communication hooks needs) and projected to the bottom MLP's width when its table is
    narrower or wider; the pairwise dot products of these vectors and the bottom MLP's
    output feed the top MLP, which gives one logit.
    """

    pairs: Tensor  # (2, n_pairs) indices of the upper triangle of the interaction matrix

    def __init__(
        self,
        dense_features: int,
        bottom: tuple[int, ...],
        tables: tuple[tuple[int, int], ...],
        pooling: tuple[int, ...],
        top: tuple[int, ...],
    ) -> None:
        super().__init__()
        width = bottom[-1]
        self.bottom = _relu_mlp((dense_features, *bottom), last_relu=True)
        self.tables = nn.ModuleList()
        self.proj = nn.ModuleList()
        for rows, dim in tables:
            table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=False)
            # DLRM's own initialisation: U(-1/sqrt(rows), 1/sqrt(rows)).
            nn.init.uniform_(table.weight, -rows**-0.5, rows**-0.5)
            self.tables.append(table)
            self.proj.append(nn.Identity() if dim == width else nn.Linear(dim, width, bias=False))
        self.bounds = [0, *np.cumsum(pooling).tolist()]
        n = len(tables) + 1
        pairs = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pairs", pairs, persistent=False)
        self.top = _relu_mlp((width + pairs.shape[1], *top, 1), last_relu=False)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        dense, sparse = inputs
        x = self.bottom(dense)
        feats = [x]
        for i, (table, proj) in enumerate(zip(self.tables, self.proj)):
            feats.append(proj(table(sparse[:, self.bounds[i] : self.bounds[i + 1]])))
        z = torch.stack(feats, dim=1)  # (batch, features, width)
        dots = torch.bmm(z, z.transpose(1, 2))
        inter = dots[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


def _relu_mlp(widths: tuple[int, ...], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _auc(scores: Tensor, labels: Tensor) -> float:
    """ROC AUC by the Mann-Whitney rank sum, ties at their average rank."""
    _, inverse, counts = torch.unique(scores.double(), return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def dlrm(
    *,
    tables: tuple[tuple[int, int], ...] = (
        (400_000, 16), (100_000, 32), (50_000, 32), (20_000, 64), (10_000, 128), (10_000, 16),
    ),
    pooling: tuple[int, ...] = (4, 2, 2, 1, 1, 1),
    zipf: float = 1.05,
    dense_features: int = 13,
    bottom: tuple[int, ...] = (128, 64, 32),
    top: tuple[int, ...] = (128, 64),
    batch_size: int = 256,
    seed: int = 0,
) -> Workload:
    """A DLRM-style click-through model on synthetic, skewed categorical data.

    With the defaults: six tables of 10^4 to 4x10^5 rows and 16 to 128 dimensions hold
    13.9 M of the model's ~13.97 M parameters (55.7 MB of fp32 gradient per step, which
    a 300 Mbit/s link needs ~1.5 s to allreduce), against ~0.1-0.2 s of compute per step
    on one core. Tables use dense gradients (``sparse=False``, what DDP's communication
    hooks need), so each step's gradient is mostly zero rows: a step touches at most
    ``batch_size * pooling`` rows of a table, and with Zipf-distributed ids far fewer
    (about 0.2% of the largest table's rows, a few percent of the 10^4-row ones).

    Each sample has ``dense_features`` Gaussian features and, per table, a bag of
    ``pooling`` row ids drawn from a Zipf law (``P(k-th most frequent) ~ k^-zipf``), the
    popular rows scattered over the table by a fixed permutation. Labels are Bernoulli
    draws from a fixed random teacher (a linear score of the dense features plus a score
    per table row), so they are learnable, and the hot rows fastest.

    To tune it: parameters and gradient bytes are the sum of ``rows * dim`` over
    ``tables``; step time grows with ``batch_size`` and with the tables' total size
    (backward writes, and SGD updates, every row of a dense table gradient).

    Args:
        tables: ``(rows, dim)`` of each embedding table.
        pooling: row ids per sample for each table (its bag size); one per table.
        zipf: the exponent of the id distribution; 0 is uniform, larger is more skewed.
        dense_features: continuous features per sample (Criteo has 13).
        bottom: widths of the bottom MLP on the dense features; the last is the width
            every embedding is projected to for the dot-product interaction.
        top: hidden widths of the top MLP (a final layer gives the logit).
        batch_size: samples per rank and step.
        seed: seeds the model, the teacher, the id permutations and the data.

    Returns:
        The workload; ``inputs`` is a ``(dense, sparse)`` pair: float
        ``(batch, dense_features)`` and long ``(batch, sum(pooling))``, table after
        table; targets are 0/1 floats, the loss is ``binary_cross_entropy_with_logits``.
        ``evaluate`` gives the ROC AUC on 4096 held-out samples.

    Raises:
        WorkloadError: ``pooling`` does not give one bag size >= 1 per table, a table
            has fewer than 1 row or dimension, or ``zipf`` is negative.
    """
    tables = tuple((int(r), int(d)) for r, d in tables)
    pooling = tuple(int(p) for p in pooling)
    if not tables or len(pooling) != len(tables) or min(pooling) < 1:
        raise WorkloadError(
            f"dlrm needs one pooling factor >= 1 per table; got tables={tables} and "
            f"pooling={pooling}"
        )
    if min(min(t) for t in tables) < 1:
        raise WorkloadError(f"dlrm tables need rows >= 1 and dim >= 1, got {tables}")
    if not zipf >= 0:
        raise WorkloadError(f"dlrm needs zipf >= 0, got {zipf}")
    model = _build(seed, lambda: _DLRM(dense_features, tuple(bottom), tables, pooling,
                                       tuple(top)))

    # The id distribution, the permutation scattering popular ids, and the teacher are
    # fixed by the seed alone: the same on every rank, whatever the step.
    cdfs, perms, scores = [], [], []
    for t, (rows, _) in enumerate(tables):
        gen = _generator(seed, _TEACHER, t)
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-zipf)
        cdf = weights.cumsum(0)
        cdfs.append(cdf / cdf[-1])
        perms.append(torch.randperm(rows, generator=gen))
        scores.append(torch.randn(rows, generator=gen))
    w_dense = torch.randn(dense_features, generator=_generator(seed, _TEACHER, len(tables)))
    w_dense /= dense_features**0.5
    # dense and table scores contribute alike; 2 makes labels mostly, not fully, decided
    scale = 2.0 / (1 + len(tables)) ** 0.5

    def sample(gen: torch.Generator, n: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        dense = torch.randn(n, dense_features, generator=gen)
        bags, logit = [], dense @ w_dense
        for cdf, perm, score, bag in zip(cdfs, perms, scores, pooling):
            u = torch.rand(n * bag, generator=gen, dtype=torch.float64)
            ids = perm[torch.searchsorted(cdf, u).clamp_(max=len(cdf) - 1)].view(n, bag)
            bags.append(ids)
            logit = logit + score[ids].mean(dim=1)
        y = torch.bernoulli(torch.sigmoid(scale * logit), generator=gen)
        return (dense, torch.cat(bags, dim=1)), y

    def make_batch(
        step: int, *, rank: int | None = None, world_size: int | None = None
    ) -> tuple[tuple[Tensor, Tensor], Tensor]:
        r, _ = _rank_world(rank, world_size)
        return sample(_generator(seed, _TRAIN, step, r), batch_size)

    (test_dense, test_sparse), test_y = sample(_generator(seed, _EVAL), 4096)

    def evaluate(m: nn.Module) -> float:
        was_training = m.training
        m.eval()
        try:
            with torch.no_grad():
                logits = torch.cat([m((test_dense[i : i + 1024], test_sparse[i : i + 1024]))
                                    for i in range(0, len(test_y), 1024)])
        finally:
            m.train(was_training)
        return _auc(logits, test_y)

    return Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=F.binary_cross_entropy_with_logits,
        name="dlrm",
        evaluate=evaluate,
    )


# ---------------------------------------------------------------------------------------
# digits


def digits(
    *,
    hidden: int = 128,
    batch_size: int = 32,
    test_fraction: float = 0.25,
    seed: int = 0,
) -> Workload:
    """An MLP on scikit-learn's bundled 8x8 digits (1797 images, 10 classes, no download).

    The data are split once (stratified, seeded) into train and test sets and
    standardised with the training set's statistics. Each rank trains on its own shard
    of the training set (every ``world_size``-th sample from its rank on), reshuffled
    every epoch by a generator seeded with ``(seed, epoch, rank)``. Plain SGD
    (lr 0.1, momentum 0.9) reaches about 0.95 test accuracy within 300 steps.

    Args:
        hidden: width of the two hidden layers.
        batch_size: samples per rank and step; at most the size of a rank's shard.
        test_fraction: share of the data held out for ``evaluate``.
        seed: seeds the split, the model and the shuffling.

    Returns:
        The workload; ``evaluate`` gives test accuracy in [0, 1].

    Raises:
        WorkloadError: ``test_fraction`` is outside (0, 1).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    if not 0.0 < test_fraction < 1.0:
        raise WorkloadError(f"digits needs test_fraction in (0, 1), got {test_fraction}")
    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data, data.target, test_size=test_fraction, random_state=seed,
        stratify=data.target,
    )
    scaler = StandardScaler().fit(x_train)
    train_x = torch.as_tensor(scaler.transform(x_train), dtype=torch.float32)
    train_y = torch.as_tensor(y_train, dtype=torch.long)
    test_x = torch.as_tensor(scaler.transform(x_test), dtype=torch.float32)
    test_y = torch.as_tensor(y_test, dtype=torch.long)
    model = _build(seed, lambda: _mlp_net(train_x.shape[1], hidden, 2, 10))

    def make_batch(step: int, *, rank: int | None = None, world_size: int | None = None) -> Batch:
        r, world = _rank_world(rank, world_size)
        shard = torch.arange(r, len(train_x), world)
        if batch_size > len(shard):
            raise WorkloadError(
                f"digits batch_size {batch_size} exceeds the {len(shard)} training samples "
                f"of rank {r}'s shard at world size {world}"
            )
        # Whole batches per epoch: the remainder of a shuffled shard waits for a later epoch.
        per_epoch = len(shard) // batch_size
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(shard), generator=_generator(seed, _TRAIN, epoch, r))
        idx = shard[order[i * batch_size : (i + 1) * batch_size]]
        return train_x[idx], train_y[idx]

    return Workload(
        model=model,
        make_batch=make_batch,
        loss_fn=F.cross_entropy,
        name="digits",
        evaluate=lambda m: _accuracy(m, test_x, test_y),
    )


BUILTINS: dict[str, Callable[[], Workload]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "dlrm": dlrm,
    "digits": digits,
}


# ---------------------------------------------------------------------------------------
# Resolving user specs

_FORMS = "a built-in name, 'path/to/file.py:function' or 'package.module:function'"


def _load_file(path_text: str) -> Any:
    """Import a Python file as a module of its own; relative paths start at the cwd."""
    path = Path(path_text).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.exists():
        raise WorkloadError(f"workload file not found: {path}")
    if not path.is_file():
        raise WorkloadError(f"workload file {path} is not a regular file")
    # A name unique to the file, so two files called workload.py do not collide.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"_autotune_workload_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise WorkloadError(f"cannot load {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses and pickling look modules up by name.
    sys.modules[module_name] = module
    try:
        # This runs the file's code, as `python file.py` would: a workload file is a
        # program the user chose to run, not data (policies and profiles are data).
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # SystemExit: a script that calls sys.exit()
        del sys.modules[module_name]
        raise WorkloadError(
            f"importing workload file {path} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _load_module(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if Path(f"{module_name}.py").is_file():  # the user meant the file in the cwd
            hint = f" (to load the file, write '{module_name}.py:FUNCTION')"
        raise WorkloadError(
            f"cannot import workload module {module_name!r}: {exc}{hint}"
        ) from exc
    except (Exception, SystemExit) as exc:
        raise WorkloadError(
            f"importing workload module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _required_args(fn: Callable[..., Any]) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; just call them
        return []
    return [
        p.name
        for p in sig.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def resolve_workload(spec: str) -> Workload:
    """Turn a workload spec into a :class:`Workload`.

    Args:
        spec: one of the names in :data:`BUILTINS` (built with its defaults);
            ``path/to/file.py:function`` (a file loaded as a module; a relative path is
            relative to the current directory); or ``package.module:function``. The
            function is called with no arguments and must return a :class:`Workload`.

    Returns:
        The workload.

    Raises:
        WorkloadError: the name is unknown, the file or module cannot be found or
            imported, the function is missing, needs arguments, fails, or returns
            something other than a :class:`Workload`.
    """
    if not isinstance(spec, str):
        raise WorkloadError(f"a workload spec must be a str, got {type(spec).__name__}")
    spec = spec.strip()
    if spec in BUILTINS:
        return BUILTINS[spec]()
    where, sep, func_name = spec.rpartition(":")
    if not sep:
        raise WorkloadError(
            f"unknown workload {spec!r}; expected {_FORMS}. "
            f"Built-ins: {', '.join(BUILTINS)}"
        )
    if not where or not func_name:
        raise WorkloadError(f"workload spec {spec!r} is incomplete; expected {_FORMS}")
    is_path = where.endswith(".py") or "/" in where or "\\" in where
    module = _load_file(where) if is_path else _load_module(where)
    source = f"workload file {where}" if is_path else f"workload module {where!r}"

    fn: Any = module
    for part in func_name.split("."):
        if not hasattr(fn, part):
            public = sorted(
                n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
            )
            raise WorkloadError(
                f"{source} has no function {func_name!r}; "
                f"it defines: {', '.join(public) or 'no public callables'}"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise WorkloadError(f"{func_name!r} in {source} is a {type(fn).__name__}, not a function")
    required = _required_args(fn)
    if required:
        raise WorkloadError(
            f"workload function {spec!r} requires arguments ({', '.join(required)}); "
            "it must be callable with no arguments (give every argument a default)"
        )
    try:
        workload = fn()
    except WorkloadError:
        raise
    except (Exception, SystemExit) as exc:
        raise WorkloadError(
            f"workload function {spec!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload function {spec!r} returned {type(workload).__name__}; "
            "expected an autotune.workloads.Workload"
        )
    return workload


def describe(workload: Workload) -> dict[str, Any]:
    """Summarise a workload's model.

    Shared (tied) parameters count once, as DDP communicates them once.

    Args:
        workload: the workload to describe.

    Returns:
        ``{"name", "num_parameters", "num_tensors", "largest_tensor"}``: the number of
        trainable scalars, of trainable tensors, and the name of the largest tensor.
    """
    params = [(n, p) for n, p in workload.model.named_parameters() if p.requires_grad]
    largest = max(params, key=lambda item: item[1].numel())[0] if params else None
    return {
        "name": workload.name,
        "num_parameters": sum(p.numel() for _, p in params),
        "num_tensors": len(params),
        "largest_tensor": largest,
    }
