#!/usr/bin/python3
"""Turns the benchmarks' JSON output into the SVG figures of docs/benchmarks.md (matplotlib, from Debian's
python3-matplotlib: scripts/setup.sh --plots; run with /usr/bin/python3, which sees Debian's packages).

    --collectives FILE  bench_collectives --benchmark_format=json (or --benchmark_out=FILE): two figures,
                        busbw against message size per collective and backend (memcpy and MPI_Allreduce of 2
                        processes as references), and gradient synchronization three ways (DataParallel's
                        reduce-add + broadcast, one all-reduce per tensor, DDP's buckets) per model and rank count
    --zero FILE         bench/zero.py --json FILE: peak memory per device against the number of devices, per ZeRO
                        stage, with the state bytes predicted from the layout
    --pytorch FILE      bench/compare_pytorch.py --json > FILE: lockstep's throughput against PyTorch's
    --roofline FILE     bench/roofline.py --json FILE: each step's GEMM FLOP rate against its roofline, per model,
                        precision and mode
    --out DIR           where the SVGs go (default docs/figures)
    --format png        PNG instead of SVG (to preview)

With --benchmark_repetitions, the median aggregate of each row is plotted. Rows that skipped (no GPU, no mpirun)
are left out; a figure whose rows are all missing is not written.
"""
import argparse
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams.update({"svg.hashsalt": "lockstep", "font.size": 9, "figure.dpi": 100})  # reproducible SVGs

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def size_of(label):
    m = re.fullmatch(r"(\d+)(B|KiB|MiB|GiB)", label)
    return int(m.group(1)) * UNITS[m.group(2)] if m else None


def benchmark_rows(path):
    """name -> counters of each row (the median aggregate when there are repetitions)."""
    with open(path) as f:
        data = json.load(f)
    rows, medians = {}, {}
    for b in data.get("benchmarks", []):
        if b.get("error_occurred"):
            continue
        name = re.sub(r"(/iterations:\d+)?(/manual_time|/real_time)?$", "", b.get("run_name", b["name"]))
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                medians[name] = b
        else:
            rows.setdefault(name, b)
    rows.update(medians)
    return rows


FORMAT = "svg"


def save(fig, out, name):
    path = os.path.join(out, name.replace(".svg", "." + FORMAT))
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None} if FORMAT == "svg" else None)
    plt.close(fig)
    print(f"wrote {path}")


def plot_collectives(rows, out):
    series = {}  # (backend, collective, ranks) -> [(bytes, busbw)]
    refs = {}
    for name, r in rows.items():
        parts = name.split("/")
        if parts[0] == "memcpy" and len(parts) == 2:
            refs.setdefault("memcpy (1 core)", []).append((size_of(parts[1][5:]), r.get("busbw", 0)))
        elif parts[0] == "mpi" and len(parts) == 4:
            label = "MPI_Allreduce, 2 processes" if parts[1] == "MPI_Allreduce" else "lockstep MPI all_reduce, 2 processes"
            refs.setdefault(label, []).append((size_of(parts[3][5:]), r.get("busbw", 0)))
        elif len(parts) == 4 and parts[2].startswith("ranks:") and parts[3].startswith("size:"):
            series.setdefault((parts[0], parts[1], int(parts[2][6:])), []).append((size_of(parts[3][5:]), r.get("busbw", 0)))
    if not series:
        return
    backends = sorted({k[0] for k in series})
    fig, axes = plt.subplots(1, len(backends), figsize=(8.5 * len(backends), 4.2), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        top = max(k[2] for k in series if k[0] == backend)
        for (b, op, k), pts in sorted(series.items()):
            if b != backend or k != top:
                continue
            pts = sorted(p for p in pts if p[0])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"{op}")
        if backend == "host":
            for label, pts in sorted(refs.items()):
                pts = sorted(p for p in pts if p[0])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="--", color="grey" if "memcpy" in label else None,
                        label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{backend}: collectives of {top} ranks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, out, "collectives_busbw.svg")


def plot_grad_sync(rows, out):
    data = {}  # (backend, model, ranks) -> {method: busbw}
    for name, r in rows.items():
        m = re.fullmatch(r"([^/]+)/grad_sync/mlp:([^/]+)/ranks:(\d+)/(.+)", name)
        if m:
            data.setdefault((m.group(1), m.group(2), int(m.group(3))), {})[m.group(4)] = r.get("busbw", 0)
    if not data:
        return
    keys = sorted(data, key=lambda k: (k[0], k[1], k[2]))
    methods = sorted({meth for v in data.values() for meth in v})
    fig, ax = plt.subplots(figsize=(max(7.5, 1.2 * len(keys)), 4.2))
    width = 0.8 / len(methods)
    for i, meth in enumerate(methods):
        ax.bar([j + i * width for j in range(len(keys))], [data[k].get(meth, 0) for k in keys], width, label=meth)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{mlp}\n{k} ranks" + ("" if b == "host" else f" ({b})") for b, mlp, k in keys], fontsize=7)
    ax.set_ylabel("gradient busbw (GB/s)")
    ax.set_title("gradient synchronization three ways (f32 gradients of MLPs, host devices)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, out, "grad_sync.svg")


def plot_zero(path, out, name="zero_memory"):
    with open(path) as f:
        report = json.load(f)
    mem = report.get("memory")
    if not mem:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for zero, label in ((0, "DDP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")):
        rows = sorted((r for r in mem["rows"] if r["zero"] == zero), key=lambda r: r["devices"])
        if not rows:
            continue
        line = ax.plot([r["devices"] for r in rows], [r["peak_bytes"] / 2**20 for r in rows], marker="o",
                       label=f"{label}: peak")[0]
        ax.plot([r["devices"] for r in rows], [r["predicted_state_bytes"] / 2**20 for r in rows], ls="--",
                color=line.get_color(), label=f"{label}: state predicted")
    ax.set_xlabel("devices (ranks)")
    ax.set_ylabel("MiB per device")
    ax.set_xticks(sorted({r["devices"] for r in mem["rows"]}))
    ax.set_ylim(bottom=0)
    widths = mem["hidden"].split(",")
    hidden = f"{widths[0]}x{len(widths)}" if len(widths) > 2 and len(set(widths)) == 1 else "-".join(widths)
    ax.set_title(f"memory per device: 784-{hidden}-10, {mem['optimizer']}, "
                 f"{mem['precision']}, batch {mem['batch']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, out, name + ".svg")


def plot_pytorch(path, out):
    with open(path) as f:
        results = [r for r in json.load(f) if r.get("mode") in ("single", "ddp")]
    if not results:
        return
    labels = [f"{r['mode']}\n784-{r['hidden'].replace(',', '-')}-10" for r in results]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r["lockstep_samples_per_second"] for r in results], 0.4, label="lockstep")
    ax.bar([x + 0.2 for x in xs], [r["pytorch_samples_per_second"] for r in results], 0.4, label="PyTorch")
    for x, r in zip(xs, results):
        ax.annotate(f"{r['ratio']:.2f}x", (x, max(r["lockstep_samples_per_second"], r["pytorch_samples_per_second"])),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("samples per second (median)")
    ax.set_title("lockstep against PyTorch, samples/s (single: 1 core; ddp: 2 ranks)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, out, "pytorch_throughput.svg")


def plot_roofline(path, out):
    with open(path) as f:
        data = json.load(f)
    rows = data.get("rows", [])
    if not rows:
        return
    models = sorted({r["hidden"] for r in rows}, key=lambda h: -int(h.split(",")[0]))
    fig, axes = plt.subplots(1, len(models), figsize=(3.4 * len(models), 3.6), sharey=True, squeeze=False)
    for ax, hidden in zip(axes[0], models):
        mine = [r for r in rows if r["hidden"] == hidden]
        labels = [f"{r['precision']}\n{'DDP 2' if r['mode'] == 'ddp' else 'one'}" for r in mine]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["step_gflops"] for r in mine], 0.4, label="step (GEMM FLOPs)")
        ax.bar([x + 0.2 for x in xs],
               [r["roofline_gflops_per_device"] * (2 if r["mode"] == "ddp" else 1) for r in mine], 0.4,
               label="roofline (best kernels, x devices)", alpha=0.6)
        for x, r in zip(xs, mine):
            ax.annotate(f"{r['ratio']:.2f}", (x, r["step_gflops"]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(f"784-{hidden.replace(',', '-')}-10", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("GFLOP/s")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"training step against its GEMM roofline ({data.get('cpu', '')})", fontsize=8)
    save(fig, out, "roofline.svg")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collectives")
    p.add_argument("--zero")
    p.add_argument("--zero-name", default="zero_memory", help="the --zero figure's file name, without extension")
    p.add_argument("--pytorch")
    p.add_argument("--roofline")
    p.add_argument("--out", default=os.path.join(here, "..", "docs", "figures"))
    p.add_argument("--format", default="svg", choices=["svg", "png"])
    a = p.parse_args()
    global FORMAT
    FORMAT = a.format
    if not (a.collectives or a.zero or a.pytorch or a.roofline):
        p.error("give at least one of --collectives, --zero, --pytorch, --roofline")
    os.makedirs(a.out, exist_ok=True)
    if a.collectives:
        rows = benchmark_rows(a.collectives)
        plot_collectives(rows, a.out)
        plot_grad_sync(rows, a.out)
    if a.zero:
        plot_zero(a.zero, a.out, a.zero_name)
    if a.pytorch:
        plot_pytorch(a.pytorch, a.out)
    if a.roofline:
        plot_roofline(a.roofline, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
