#!/usr/bin/env python3
"""Checkpoint speed, side by side: lockstep's save and load (bench_checkpoint) against torch.save / torch.load of
the same state (the 784-4096-4096-10 MLP's weights and SGD momentum, 20M parameters, about 160 MB) and against
dd writing as many bytes, all to the same directory, alternated round by round (this machine drifts by 30%).

  python3 bench/compare_checkpoint_speed.py --bench-checkpoint build/rel/bench/bench_checkpoint [--dir DIR]
                                            [--rounds 5]

Every figure is a median over the rounds. lockstep's `save/page_cache` row is the one to compare with torch.save
and dd, which do not fsync; `save/fsync` (the default durability) is reported beside it. Needs PyTorch (Debian:
python3-torch; run with /usr/bin/python3 if another python3 comes first on PATH).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def lockstep_round(exe, directory, widths):
    """One run of the save and load rows; returns {row: seconds per iteration}."""
    out = subprocess.run(
        [exe, f"--dir={directory}", f"--widths={widths}", "--benchmark_filter=^(save|load)/",
         "--benchmark_min_time=1", "--benchmark_format=json"],
        check=True, capture_output=True, text=True).stdout
    rows = {}
    for b in json.loads(out)["benchmarks"]:
        rows[b["name"].split("/mlp:")[0]] = b["real_time"] / 1e3  # ms -> s
    return rows


def torch_round(torch, directory, widths, repeats=3):
    """torch.save and torch.load of the model's state_dict plus SGD momentum; best-of-`repeats` seconds each."""
    sizes = [int(w) for w in widths.split("-")]
    layers = []
    for i in range(len(sizes) - 1):
        layers += [torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.zeros(2, sizes[0])).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    path = os.path.join(directory, "torch_checkpoint.pt")
    save, load = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.save(state, path)
        save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(path)
        load.append(time.perf_counter() - t0)
        nbytes = os.path.getsize(path)
        os.remove(path)
    return min(save), min(load), nbytes


def dd_round(directory, nbytes):
    """dd of `nbytes` from /dev/zero to a new file (page cache, no fsync); seconds."""
    path = os.path.join(directory, "dd_file")
    block = 16 << 20
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={(nbytes + block - 1) // block}"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    os.remove(path)
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-checkpoint", required=True, help="path of the bench_checkpoint binary")
    ap.add_argument("--dir", help="where to write (default: a temporary directory under /tmp)")
    ap.add_argument("--widths", default="784-4096-4096-10")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"compare_checkpoint_speed: PyTorch is not installed ({e}); Debian: python3-torch")
        return 77
    torch.set_num_threads(1)
    directory = args.dir or tempfile.mkdtemp(prefix="lockstep_ckpt_speed.")
    os.makedirs(directory, exist_ok=True)
    rows = {}
    torch_save, torch_load, dd = [], [], []
    nbytes = 0
    try:
        for r in range(args.rounds):
            for name, seconds in lockstep_round(args.bench_checkpoint, directory, args.widths).items():
                rows.setdefault(name, []).append(seconds)
            s, l, nbytes = torch_round(torch, directory, args.widths)
            torch_save.append(s)
            torch_load.append(l)
            dd.append(dd_round(directory, nbytes))
            print(f"round {r + 1}: lockstep save {rows['save/page_cache'][-1]:.3f} s, fsync {rows['save/fsync'][-1]:.3f} s,"
                  f" load {rows['load'][-1]:.3f} s; torch.save {s:.3f} s, torch.load {l:.3f} s; dd {dd[-1]:.3f} s",
                  flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    med = statistics.median
    save, fsync, load = med(rows["save/page_cache"]), med(rows["save/fsync"]), med(rows["load"])
    mb = nbytes / 1e6
    print(f"\nmodel {args.widths}, {mb:.0f} MB (torch.save's file), medians of {args.rounds} alternated rounds")
    print(f"{'':24} {'seconds':>8} {'GB/s':>7}")
    for label, seconds in [("lockstep save", save), ("lockstep save + fsync", fsync), ("lockstep load", load),
                           ("torch.save", med(torch_save)), ("torch.load", med(torch_load)), ("dd (page cache)", med(dd))]:
        print(f"{label:24} {seconds:8.3f} {mb / 1e3 / seconds:7.2f}")
    print(f"\nsave: {med(torch_save) / save:.1f}x torch.save, {med(dd) / save:.2f}x dd's bandwidth "
          f"(targets: 3x, 0.5x); load: {med(torch_load) / load:.1f}x torch.load (target: 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
