"""Benchmark: encode+decode time per MB of gradient for every compressor, against a
memcpy of the same bytes.

For each compressor configuration and gradient size (fp32 matrices ``(n / 1024, 1024)``,
so PowerSGD compresses them too), times ``compressor.reduce([g], [name], LocalComm(W))``
(W identical simulated ranks in this process: decode handles W payloads, as on a real
cluster, and no network is touched; every registered method, those not listed in
CONFIGS at their defaults) interleaved with ``dst.copy_(src)`` of the same
bytes: memcpy, reduce, reduce, memcpy, ... so that both see the same machine load. The
compressor keeps its state across repeats (error feedback, PowerSGD's Q), as in
training; two untimed reductions build it first.

Reported per configuration and size (medians over the repeats):

- ``reduce_s``: the whole ``reduce`` call;
- ``comm_s``: the part spent inside LocalComm's collectives (a multiplication by W for
  allreduce, W copies of the payload for all_gather: the stand-in for the network);
- ``codec_s`` = reduce - comm: encode + decode, the cost of the codec itself; its ratio
  to the memcpy is checked against the targets below;
- for PowerSGD, ``matmul_s``: its four matrix products of the same shapes alone (``M Q``
  and ``M^T P`` of the power iteration, the residual ``M - P Q^T`` written in place, and
  the decoded ``P Q^T``), and their share of ``codec_s``; the rest is the error
  feedback's addition, the orthogonalisation and the small collectives' packing.

Targets (issue 12): fp16, bf16, int8, sign <= 3x memcpy; top-k <= 5x memcpy; PowerSGD
dominated by its matmuls. One torch thread by default, as a training rank here has.

Writes JSON (default bench/results/codec_throughput.json, ``..._cuda.json`` for
``--device cuda``) and prints a table. ``autotune.models.external.MeasuredCodecCosts``
reads it for the what-ifs of Zhang et al.'s GPU profiles (measure two world sizes,
``--world-size 2 8``, for the cost of decoding W payloads); the cost model of a profiled
job takes codec times from the codec probe, measured on the live job.

    python bench/codec_throughput.py [--sizes-mb 1 4 16 64] [--world-size 2]
        [--repeats 15] [--threads 1] [--device cpu|cuda] [--only topk ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from rich.console import Console
from rich.table import Table

from autotune import compressors
from autotune.compressors import CompressorSpec, LocalComm
from autotune.errors import AutotuneError
from autotune.jsonio import dumps, write_atomic

MB = 2**20
COLS = 1024  # gradients are (n / COLS, COLS) matrices
# (label, spec): every registered method, top-k and PowerSGD at two sizes each
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("none", {"compressor": "none"}),
    ("fp16", {"compressor": "fp16"}),
    ("bf16", {"compressor": "bf16"}),
    ("int8", {"compressor": "int8"}),
    ("sign", {"compressor": "sign"}),
    ("topk 0.1", {"compressor": "topk", "ratio": 0.1}),
    ("topk 0.01", {"compressor": "topk", "ratio": 0.01}),
    ("topk 0.001", {"compressor": "topk", "ratio": 0.001}),
    ("powersgd 1", {"compressor": "powersgd", "rank": 1}),
    ("powersgd 4", {"compressor": "powersgd", "rank": 4}),
]
# the most codec_s / memcpy_s each method may cost (None: no ratio target)
TARGETS: Mapping[str, float | None] = {
    "none": None, "fp16": 3.0, "bf16": 3.0, "int8": 3.0, "sign": 3.0, "topk": 5.0,
    "powersgd": None,
}


class SyncedLocalComm(LocalComm):
    """LocalComm whose collectives wait for the device before and after, so that on a
    GPU (asynchronous) their device work is counted as communication, not codec."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        _sync(tensor.device)
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        _sync(tensor.device)
        return super().all_gather(tensor)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        out = super()._all_reduce(tensor)
        _sync(tensor.device)
        return out

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = super()._all_gather(tensor)
        _sync(tensor.device)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def measure(label: str, spec: CompressorSpec, size_mb: float, world: int, repeats: int,
            device: torch.device) -> dict[str, Any]:
    """Median times of one configuration at one size (see the module docstring)."""
    now = _timer(device)
    n = int(size_mb * MB) // 4
    shape = (n // COLS, COLS)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=gen).to(device)
    work, src, dst = torch.empty_like(grad), grad.clone(), torch.empty_like(grad)
    comp = compressors.create(spec.name, **spec.kwargs)

    def reduce() -> tuple[float, float]:
        work.copy_(grad)
        comm = SyncedLocalComm(world)
        start = now()
        comp.reduce([work], ["grad"], comm)
        elapsed = now() - start
        return elapsed, sum(comm.seconds.values())

    def memcpy() -> float:
        start = now()
        dst.copy_(src)
        return now() - start

    matmul: Callable[[], float] | None = None
    if spec.name == "powersgd":
        rank = spec.canonical().kwargs["rank"]
        q = torch.randn(COLS, rank, generator=gen).to(device)
        p = torch.randn(shape[0], rank, generator=gen).to(device)

        scratch = grad.clone()  # the residual, rewritten in place as powersgd.py does
        rebuilt = torch.empty_like(grad)

        def matmul() -> float:  # its four BLAS calls, alone, as powersgd.py makes them:
            start = now()  # P = (Q^T M^T)^T and Q = (P^T M)^T, the residual M - P Q^T
            q.t() @ grad.t()  # in place, and the decoded P Q^T into the gradient
            p.t() @ grad
            scratch.addmm_(p, q.t(), alpha=-1)
            torch.matmul(p, q.t(), out=rebuilt)
            return now() - start

    for _ in range(2):  # untimed: builds the residual and Q, warms caches and allocator
        reduce()
        memcpy()
    copies: list[float] = []
    totals: list[float] = []
    comms: list[float] = []
    codecs: list[float] = []
    matmuls: list[float] = []
    for rep in range(repeats):
        steps: list[str] = ["copy", "reduce"] if rep % 2 == 0 else ["reduce", "copy"]
        if matmul is not None:
            steps.append("matmul")
        for step in steps:
            if step == "copy":
                copies.append(memcpy())
            elif step == "reduce":
                total, comm = reduce()
                totals.append(total)
                comms.append(comm)
                codecs.append(total - comm)
            else:
                assert matmul is not None
                matmuls.append(matmul())
    memcpy_s = statistics.median(copies)
    codec_s = statistics.median(codecs)
    mb = n * 4 / MB
    row: dict[str, Any] = {
        "spec": spec.to_dict(), "label": label, "method": spec.name,
        "size_mb": mb, "shape": list(shape), "numel": n,
        "wire_bytes": comp.wire_bytes(shape, world),
        "memcpy_s": memcpy_s, "reduce_s": statistics.median(totals),
        "comm_s": statistics.median(comms), "codec_s": codec_s,
        "codec_s_per_mb": codec_s / mb, "memcpy_s_per_mb": memcpy_s / mb,
        "ratio": codec_s / memcpy_s, "target": TARGETS.get(spec.name),
    }
    if matmuls:
        row["matmul_s"] = statistics.median(matmuls)
        row["matmul_share"] = row["matmul_s"] / codec_s
    target = row["target"]
    row["meets_target"] = None if target is None else bool(row["ratio"] <= target)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64],
                        help="gradient sizes in MiB of fp32 (default: 1 4 16 64)")
    parser.add_argument("--world-size", type=int, nargs="+", default=[2],
                        help="simulated ranks (decode handles this many payloads); several "
                             "values measure each (default: 2)")
    parser.add_argument("--repeats", type=int, default=15,
                        help="timed runs per configuration and size, medians reported "
                             "(default: 15)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: 1, as one training rank here)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--only", nargs="+", default=None, metavar="LABEL",
                        help="only configurations whose label starts with one of these")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON output (default: bench/results/codec_throughput.json, "
                             "codec_throughput_cuda.json for --device cuda)")
    args = parser.parse_args(argv)
    console = Console()
    if args.repeats < 1 or args.threads < 1 or min(args.world_size) < 1 or min(args.sizes_mb) <= 0:
        console.print("[red]--repeats, --threads and --world-size must be >= 1, sizes > 0[/red]")
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda: torch sees no CUDA device[/red]")
        return 2
    if device.type not in ("cpu", "cuda"):
        console.print(f"[red]--device must be cpu or cuda, got {args.device!r}[/red]")
        return 2
    out = args.out or Path(__file__).parent / "results" / (
        "codec_throughput.json" if device.type == "cpu" else f"codec_throughput_{device.type}.json")
    torch.set_num_threads(args.threads)
    # every registered method: those without a configuration above at their defaults
    listed = {d["compressor"] for _, d in CONFIGS}
    extra = [(name, {"compressor": name}) for name in compressors.names() if name not in listed]
    configs = [(label, CompressorSpec.from_dict(d)) for label, d in CONFIGS + extra
               if args.only is None or any(label.startswith(o) for o in args.only)]

    rows = []
    started = time.perf_counter()
    with console.status("measuring") as status:
        for world in args.world_size:
            for size in args.sizes_mb:
                for label, spec in configs:
                    status.update(f"W={world} {size:g} MB {label}")
                    rows.append({"world_size": world, **measure(label, spec, size, world, args.repeats, device)})
    wall = time.perf_counter() - started

    title = (f"codec throughput on {device.type} ({args.threads} thread(s)), "
             f"medians of {args.repeats}; codec = reduce - LocalComm")
    table = Table(title=title)
    for col in ("W", "MB", "compressor", "memcpy ms/MB", "codec ms/MB", "codec/memcpy",
                "target", "matmuls"):
        table.add_column(col, justify="left" if col == "compressor" else "right")
    for r in rows:
        ok = r["meets_target"]
        target = "" if r["target"] is None else f"<= {r['target']:g} " + ("ok" if ok else "[red]MISS[/red]")
        mm = f"{r['matmul_share']:.0%} of codec" if "matmul_share" in r else ""
        table.add_row(str(r["world_size"]), f"{r['size_mb']:g}", r["label"],
                      f"{r['memcpy_s_per_mb'] * 1e3:.3f}", f"{r['codec_s_per_mb'] * 1e3:.3f}",
                      f"{r['ratio']:.2f}", target, mm)
    console.print(table)
    result = {
        "device": device.type,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "threads": args.threads, "repeats": args.repeats, "world_sizes": args.world_size,
        "sizes_mb": args.sizes_mb, "torch": torch.__version__, "wall_s": wall, "rows": rows,
    }
    try:
        write_atomic(out, dumps(result), AutotuneError, "results")
    except AutotuneError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
