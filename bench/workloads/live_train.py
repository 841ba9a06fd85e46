"""A plain DDP training script, as a PyTorch tutorial writes one, for bench/live_auto.py.

Run it under torchrun or ``autotune launch`` (it reads RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and initialises its own process group):

    autotune launch --hosts 2 --nproc-per-node 1 --link 300mbit bench/workloads/live_train.py --model cnn --mode auto

``--mode`` picks how gradients are averaged: ``ddp`` (DistributedDataParallel as is),
``powersgd`` (PyTorch's own PowerSGD hook, rank 1, one bucket: with two or more it
deadlocks on gloo), ``policy`` (``autotune.wrap(model, FILE)``), ``auto``
(``autotune.wrap(model, "auto", save=FILE)``). Models: ``cnn`` (small convolutions and a
2 MB dense layer) and ``embed`` (a 20000 x 32 embedding bag, row-sparse gradients, and
a small MLP). The data are synthetic and learnable (cnn: each class a fixed random
image under noise; embed: labels from a fixed random teacher), so the loss falls. Rank 0
writes each step's time (the slowest rank's), the wall time, the final loss and whether
the ranks' parameters are equal to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 8 * 8, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BagNet(nn.Module):
    def __init__(self, vocab: int = 20000, dim: int = 32) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.fc1 = nn.Linear(dim, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self.bag(tokens))))


def batches(model: str, rank: int, batch: int = 32):
    """An endless stream of (inputs, labels) for this rank, labelled by a fixed teacher."""
    teacher = torch.Generator().manual_seed(1234)
    gen = torch.Generator().manual_seed(100 + rank)
    if model == "cnn":  # each class a fixed random image, seen through noise
        prototypes = torch.randn(10, 3, 32, 32, generator=teacher)
        while True:
            labels = torch.randint(0, 10, (batch,), generator=gen)
            yield 0.5 * prototypes[labels] + torch.randn(batch, 3, 32, 32, generator=gen), labels
    else:
        table = torch.randn(20000, 10, generator=teacher)
        weights = 1.0 / torch.arange(1, 20001, dtype=torch.float64) ** 1.1  # Zipf-like
        while True:
            tokens = torch.multinomial(weights, batch * 16, replacement=True, generator=gen)
            tokens = tokens.view(batch, 16)
            yield tokens, table[tokens].sum(1).argmax(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("cnn", "embed"), default="cnn")
    parser.add_argument("--mode", choices=("ddp", "powersgd", "policy", "auto"), default="ddp")
    parser.add_argument("--policy", help="policy JSON (--mode policy) or where auto saves it")
    parser.add_argument("--log", help="auto: the controller's JSONL decision log")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", required=True, help="rank 0 writes its results here (JSON)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ConvNet() if args.model == "cnn" else BagNet()

    summary = None
    if args.mode == "ddp":
        model = DDP(model)
    elif args.mode == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        model = DDP(model, bucket_cap_mb=1024)  # one bucket: gloo deadlocks with more
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=2)
        model.register_comm_hook(state, psgd.powerSGD_hook)
    else:
        import autotune

        if args.mode == "policy":
            model = autotune.wrap(model, args.policy)
        else:
            model = autotune.wrap(model, "auto", save=args.policy, log=args.log)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    data = batches(args.model, rank)
    times, losses = [], []
    started = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        inputs, labels = next(data)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    wall = time.perf_counter() - started

    step_s = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    final = torch.tensor([sum(losses[-20:]) / 20], dtype=torch.float64)
    dist.all_reduce(final)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    mine = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if args.mode == "auto":
        summary = model.controller.summary
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"model": args.model, "mode": args.mode, "step_s": step_s.tolist(),
                       "wall_s": wall, "final_loss": float(final) / dist.get_world_size(),
                       "params_equal": all(torch.equal(every[0], d) for d in every),
                       "auto": summary,
                       "policy": getattr(getattr(model, "policy", None), "id", None)}, fh)
    dist.barrier()  # the results are written before any rank tears down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
