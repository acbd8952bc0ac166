#!/usr/bin/env python3
"""Deterministic mode, measured with the sample (examples/mlp_train): what it costs, that it keeps the accuracy,
and that one epoch ends with the same weights in every mode and on every number of devices.

    cost      ms per training step with and without --deterministic, alternated (ordinary, deterministic,
              ordinary, ...) so that a noisy neighbour slows both; the median of each side's --repeats runs of
              --steps steps and the ratio of the medians. On one host device and with DDP on 2, for each of
              --hidden; DDP also with --exact-sums accumulators (exact sums all-reduced, not partial gradients
              gathered). --chunk-rows lists the chunk sizes measured (default 32).
    accuracy  the test accuracy after the sample's full recipe (5 epochs, cosine schedule) for each of --seeds,
              with and without --deterministic, on one host device; the largest difference.
    hashes    weights_sha256 after --epochs epochs (default 1) for single, dp on 2/3/4 host devices, DDP on 2/3/4
              threads (and on 2 with --exact-sums accumulators), ZeRO-1 on 3 and ZeRO-2 on 4 and, with --mpirun,
              under `mpirun -np 2` and `-np 3`, for each of --batches and --precisions; one line per
              configuration and whether every mode agrees.

Usage: bench/determinism.py [--mlp-train PATH] [--modes cost accuracy hashes] [--hidden 256,256 1024,1024]
                            [--steps N] [--repeats R] [--seeds 0 1 2 3] [--batches 128 130]
                            [--precisions f32 f16 bf16] [--cost-precisions f32 bf16] [--epochs N]
                            [--mpirun "mpirun --oversubscribe ..."]
                            [--json]
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys


def run(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}{out.stdout[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mlp-train", default=os.path.join(here, "..", "build", "rel", "examples", "mlp_train", "mlp_train"))
    p.add_argument("--modes", nargs="+", default=["cost", "accuracy", "hashes"])
    p.add_argument("--hidden", nargs="+", default=["256,256", "1024,1024"])
    p.add_argument("--chunk-rows", nargs="+", type=int, default=[32])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    p.add_argument("--batches", nargs="+", type=int, default=[128, 130])
    p.add_argument("--precisions", nargs="+", default=["f32", "f16", "bf16"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--cost-precisions", nargs="+", default=["f32"], help="cost mode: the precisions measured")
    p.add_argument("--mpirun", default="")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    env = dict(os.environ, LOCKSTEP_HOST_DEVICES="4")
    env.pop("LOCKSTEP_HOST_STRICT", None)  # a test-time mode: measure the library as users run it
    report = {}

    if "cost" in a.modes:
        rows = []
        for hidden, precision in [(h, p) for h in a.hidden for p in a.cost_precisions]:
            for mode, devices in (("single", "host:0"), ("ddp", "host:0,host:1")):
                for chunk in a.chunk_rows:
                    base = [a.mlp_train, "--mode", mode, "--devices", devices, "--hidden", hidden, "--batch", "128",
                            "--max-steps", str(a.steps), "--lr-schedule", "constant", "--precision", precision,
                            "--json"]
                    # DDP two ways: the partial gradients gathered (auto, when they fit) and exact sums all-reduced
                    sides = {"ordinary": [], "deterministic": []}
                    if mode == "ddp":
                        sides["accumulators"] = []
                    for _ in range(a.repeats):
                        for side in sides:
                            extra = [] if side == "ordinary" else ["--deterministic", "--chunk-rows", str(chunk)]
                            if side == "accumulators":
                                extra += ["--exact-sums", "accumulators"]
                            j = run(base + extra, env)
                            sides[side].append(1000.0 * j["train_seconds"] / j["steps"])
                    o, d = statistics.median(sides["ordinary"]), statistics.median(sides["deterministic"])
                    row = {"hidden": hidden, "precision": precision, "mode": mode, "devices": devices, "chunk_rows": chunk,
                           "ordinary_ms": o, "deterministic_ms": d, "ratio": d / o}
                    if "accumulators" in sides:
                        acc = statistics.median(sides["accumulators"])
                        row.update({"accumulators_ms": acc, "accumulators_ratio": acc / o})
                    rows.append(row)
        report["cost"] = rows
        if not a.json:
            print(f"cost: ms per step, batch 128, median of {a.repeats} alternated runs of {a.steps} steps")
            print("| model | precision | mode | chunk rows | ordinary | deterministic | ratio | DDP, exact sums all-reduced |")
            print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
            for r in rows:
                acc = f"{r['accumulators_ms']:.2f} ({r['accumulators_ratio']:.2f}x)" if "accumulators_ms" in r else ""
                print(f"| 784-{r['hidden'].replace(',', '-')}-10 | {r['precision']} | {r['mode']} ({r['devices']}) | {r['chunk_rows']} | "
                      f"{r['ordinary_ms']:.2f} | {r['deterministic_ms']:.2f} | {r['ratio']:.2f}x | {acc} |")

    if "accuracy" in a.modes:
        rows = []
        for seed in a.seeds:
            base = [a.mlp_train, "--devices", "host:0", "--seed", str(seed), "--json"]
            o = run(base, env)["test_accuracy"]
            d = run(base + ["--deterministic"], env)["test_accuracy"]
            rows.append({"seed": seed, "ordinary": o, "deterministic": d})
        report["accuracy"] = rows
        if not a.json:
            print("accuracy after 5 epochs on one host device")
            print("| seed | ordinary | deterministic | difference (points) |")
            print("| ---: | ---: | ---: | ---: |")
            for r in rows:
                print(f"| {r['seed']} | {r['ordinary']:.4f} | {r['deterministic']:.4f} | "
                      f"{100 * (r['deterministic'] - r['ordinary']):+.2f} |")

    if "hashes" in a.modes:
        configs = [("single", ["--mode", "single", "--devices", "host:0"], [])]
        for k in (2, 3, 4):
            devs = ",".join(f"host:{i}" for i in range(k))
            configs.append((f"dp {k}", ["--mode", "dp", "--devices", devs], []))
        for k in (2, 3, 4):
            devs = ",".join(f"host:{i}" for i in range(k))
            configs.append((f"ddp {k}", ["--mode", "ddp", "--devices", devs], []))
        configs.append(("ddp 2 accumulators", ["--mode", "ddp", "--devices", "host:0,host:1", "--exact-sums",
                                               "accumulators"], []))
        configs.append(("zero-1 3", ["--mode", "ddp", "--devices", "host:0,host:1,host:2", "--zero", "1"], []))
        configs.append(("zero-2 4", ["--mode", "ddp", "--devices", "host:0,host:1,host:2,host:3", "--zero", "2"], []))
        if a.mpirun:
            for k in (2, 3):
                configs.append((f"mpirun -np {k}", ["--mode", "ddp"], shlex.split(a.mpirun) + ["-np", str(k)]))
        rows = []
        for precision in a.precisions:
            for batch in a.batches:
                common = ["--epochs", str(a.epochs), "--batch", str(batch), "--precision", precision,
                          "--deterministic", "--json"]
                hashes = {}
                for name, args, launcher in configs:
                    j = run(launcher + [a.mlp_train] + args + common, env)
                    hashes[name] = (j["weights_sha256"], j["test_accuracy"])
                agree = len({h for h, _ in hashes.values()}) == 1
                rows.append({"precision": precision, "batch": batch, "hashes": hashes, "agree": agree})
                if not a.json:
                    first = next(iter(hashes.values()))
                    print(f"{precision} batch {batch}: {len(hashes)} configurations "
                          f"{'agree' if agree else 'DIFFER'}: weights_sha256 {first[0][:16]}..., "
                          f"accuracy {first[1]:.4f}")
                    if not agree:
                        for name, (h, acc) in hashes.items():
                            print(f"    {name:14s} {h} {acc:.4f}")
        report["hashes"] = rows
    if a.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
