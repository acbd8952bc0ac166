#!/usr/bin/env python3
"""ZeRO measured with the sample (examples/mlp_train --mode ddp --zero 0..3): memory per device and step time.

    memory  for 1..--max-devices host devices and the ZeRO --stages (default 0 (plain DDP) to 3): the peak memory per device
            over a few training steps of --memory-hidden (default 4096,4096: 784-4096-4096-10, 20 M parameters)
            and while building (the setup peak: the model, the wrapper, under ZeRO without whole masters),
            AdamW, --memory-precision (default f16), batch 128 (126 on 3 devices); the bytes the sample reports for the parameters
            (working copies and fp32 masters), the gradients (with the buffers they are reduced in) and the
            optimizer state; and the bytes predicted from the layout (below). The largest device of each run.
    speed   ms per step of DDP and the ZeRO --stages on each of --speed-devices host device counts (default 2) for --speed-hidden
            (default 1024,1024: 784-1024-1024-10) with the sample's recipe otherwise (f32, SGD, batch 128),
            alternated (DDP, ZeRO-1, ZeRO-2, ZeRO-3, DDP, ...): the median of --repeats runs of --steps steps, and each
            stage's ratio to DDP.

Predicted state bytes per parameter (P parameters, N ranks, f16/bf16 AdamW), from how lockstep lays them out:
    DDP     2 (working copy) + 2 (the f16 gradient, reduced in place: host cliques and MPI sum it in fp32)
            + 4 (master) + 8 (moments) = 16 (on NCCL, 4 more: its fp32 bucket beside the gradient)
    ZeRO-1  2 + 2 (gradients reduced in place, in their type) + 12 / N (master and moments of the shard)
    ZeRO-2  2 + B / P (two reused bucket buffers, B bytes: the largest bucket of each parity) + 2 / N + 12 / N
    ZeRO-3  B / P + 2 / N (the working copy's shard) + 2 / N + 12 / N, between steps, B from buckets that keep a
            layer whole and close at a layer's end past 1 MiB; during a step the values of a few buckets are gathered
            at a time (graph models, as the sample's: layer by layer), about two to four layers' 2 bytes a parameter
(f32: the working copy is the master, and the f32 gradients are reduced in place in every stage.)
Predicted step peak: the state, plus the activations a step keeps (per device rows x (input, every hidden width
twice: the linear's output and the activation's, the logits) in the compute type), plus under ZeRO-3 the whole values
of the two adjacent buckets held at once (forward holds the child's bucket and gathers one ahead; backward frees a
bucket once its gradients are launched and gathers the one two above). The report's gathered peak under ZeRO-3 (the most
bytes of whole values held at once) is printed next to those two buckets' bytes.

Usage: bench/zero.py [--mlp-train PATH] [--modes memory speed] [--stages 0 1 2 3] [--max-devices 4] [--speed-devices 1 2 3 4]
                     [--steps N] [--repeats R] [--json FILE]
Writes the figures as JSON (for bench/plot.py) with --json, and prints markdown tables.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}{out.stdout[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n):
    return n / 1048576.0


def model_parameters(hidden):
    widths = [784] + [int(w) for w in hidden.split(",")] + [10]
    return [(widths[i + 1] * widths[i], widths[i + 1]) for i in range(len(widths) - 1)]  # (weight, bias) per layer


def ddp_buckets(hidden, elem_bytes, first=1 << 20, rest=25 << 20, by_layer=False):
    """The bucket sizes in bytes DDP builds (reverse parameter order, 1 MiB first bucket, 25 MiB after); by_layer
    (ZeRO-3 on a graph): a layer's weight and bias never split, and a bucket closes at a layer's end past 1 MiB."""
    units = [[w, b] for w, b in model_parameters(hidden)] if by_layer else [[n] for wb in model_parameters(hidden) for n in wb]
    buckets, current, limit = [], 0, first
    for unit in reversed(units):
        nbytes = sum(unit) * elem_bytes
        if current and (current + nbytes > limit or (by_layer and current >= first)):
            buckets.append(current)
            current, limit = 0, rest
        current += nbytes
    buckets.append(current)
    return buckets


def predicted(hidden, precision, zero, n):
    """Predicted bytes of the training state per device (see the module docstring)."""
    p = sum(w + b for w, b in model_parameters(hidden))
    low = precision != "f32"
    if not low:  # f32: values are the masters; gradients f32 in place
        if zero == 0 or n == 1:
            return p * (4 + 4 + 8)
        reused = ddp_buckets(hidden, 4, by_layer=zero == 3)
        grads = 4 * p if zero == 1 else sum(max(reused[i::2], default=0) for i in (0, 1)) + 4 * p / n
        return (4 * p if zero < 3 else 4 * p / n) + grads + 8 * p / n
    if zero == 0 or n == 1:
        return p * (2 + 2 + 4 + 8)  # host devices: DDP reduces f16/bf16 gradients in place, as ZeRO does
    if zero == 1:
        return p * (2 + 2) + 12 * p / n
    reused = ddp_buckets(hidden, 2, by_layer=zero == 3)
    buffers = sum(max(reused[i::2], default=0) for i in (0, 1))
    return (2 * p if zero < 3 else 2 * p / n) + buffers + 2 * p / n + 12 * p / n


def element_bytes(precision):
    """Bytes of one value forward reads in `precision` (the compute type)."""
    return 4 if precision == "f32" else 2


def activation_bytes(hidden, precision, rows):
    """The activations a step keeps on a device (see the module docstring)."""
    widths = [int(w) for w in hidden.split(",")]
    return rows * (784 + 2 * sum(widths) + 10) * element_bytes(precision)


def predicted_gathered(hidden, precision, zero, n):
    """ZeRO-3: the predicted most bytes of whole values a step holds gathered at once (two adjacent buckets)."""
    if zero != 3 or n < 2:
        return 0
    held = ddp_buckets(hidden, element_bytes(precision), by_layer=True)
    return max((held[i] + held[i + 1] for i in range(len(held) - 1)), default=held[0])


def predicted_peak(hidden, precision, zero, n, batch):
    """Predicted peak bytes of a training step per device (see the module docstring)."""
    return (predicted(hidden, precision, zero, n) + activation_bytes(hidden, precision, batch // n)
            + predicted_gathered(hidden, precision, zero, n))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mlp-train", default=os.path.join(here, "..", "build", "rel", "examples", "mlp_train", "mlp_train"))
    p.add_argument("--modes", nargs="+", default=["memory", "speed"])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--max-devices", type=int, default=4)
    p.add_argument("--memory-hidden", default="4096,4096")
    p.add_argument("--memory-precision", default="f16")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--speed-devices", type=int, nargs="+", default=[2])
    p.add_argument("--speed-hidden", default="1024,1024")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="")
    a = p.parse_args()
    env = dict(os.environ, LOCKSTEP_HOST_DEVICES=str(max([a.max_devices] + a.speed_devices)))
    stages = sorted(set([0] + a.stages))  # DDP: what the others are compared with
    env.pop("LOCKSTEP_HOST_STRICT", None)  # a test-time mode: measure the library as users run it
    report = {}

    if "memory" in a.modes:
        rows = []
        for n in range(1, a.max_devices + 1):
            devices = ",".join(f"host:{i}" for i in range(n))
            for zero in stages:
                batch = 128 // n * n  # DDP splits a batch evenly: 126 on 3 devices
                j = run([a.mlp_train, "--mode", "ddp", "--devices", devices, "--zero", str(zero), "--hidden",
                         a.memory_hidden, "--optimizer", "adamw", "--lr", "0.001", "--precision", a.memory_precision,
                         "--batch", str(batch), "--max-steps", str(a.memory_steps), "--lr-schedule", "constant", "--json"],
                        env)
                d = max(j["per_device"], key=lambda x: x["peak_memory_bytes"])
                rows.append({"devices": n, "zero": zero, "batch": batch, "peak_bytes": d["peak_memory_bytes"],
                             "setup_peak_bytes": max(x["setup_peak_memory_bytes"] for x in j["per_device"]),
                             "parameter_bytes": d["parameter_bytes"], "gradient_bytes": d["gradient_bytes"],
                             "optimizer_bytes": d["optimizer_bytes"],
                             "gathered_peak_bytes": max(x.get("gathered_peak_bytes", 0) for x in j["per_device"]),
                             "predicted_gathered_bytes": predicted_gathered(a.memory_hidden, a.memory_precision, zero, n),
                             "predicted_state_bytes": predicted(a.memory_hidden, a.memory_precision, zero, n),
                             "predicted_peak_bytes": predicted_peak(a.memory_hidden, a.memory_precision, zero, n, batch)})
        for r in rows:
            base = next(x for x in rows if x["devices"] == r["devices"] and x["zero"] == 0)
            r["peak_vs_ddp"] = r["peak_bytes"] / base["peak_bytes"]
        report["memory"] = {"hidden": a.memory_hidden, "precision": a.memory_precision, "optimizer": "adamw",
                            "batch": 128, "rows": rows}
        print(f"memory per device: 784-{a.memory_hidden.replace(',', '-')}-10, AdamW, {a.memory_precision}, batch 128, "
              f"{a.memory_steps} steps (MiB; the largest device)")
        print("| devices | stage | peak | peak predicted | vs DDP | setup peak | parameters | gradients | optimizer | state measured | state predicted | gathered peak | gathered predicted |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            state = r["parameter_bytes"] + r["gradient_bytes"] + r["optimizer_bytes"]
            print(f"| {r['devices']} | {'DDP' if r['zero'] == 0 else 'ZeRO-' + str(r['zero'])} | {mib(r['peak_bytes']):.1f} | "
                  f"{mib(r['predicted_peak_bytes']):.1f} | {r['peak_vs_ddp']:.2f} | {mib(r['setup_peak_bytes']):.1f} | {mib(r['parameter_bytes']):.1f} | {mib(r['gradient_bytes']):.1f} | "
                  f"{mib(r['optimizer_bytes']):.1f} | {mib(state):.1f} | {mib(r['predicted_state_bytes']):.1f} | "
                  f"{mib(r['gathered_peak_bytes']):.1f} | {mib(r['predicted_gathered_bytes']):.1f} |")

    if "speed" in a.modes:
        speed = {"hidden": a.speed_hidden, "steps": a.steps, "repeats": a.repeats, "rows": []}
        for n in a.speed_devices:
            devices = ",".join(f"host:{i}" for i in range(n))
            batch = 128 // n * n
            times = {z: [] for z in stages}
            for _ in range(a.repeats):
                for zero in stages:
                    j = run([a.mlp_train, "--mode", "ddp", "--devices", devices, "--zero", str(zero), "--hidden",
                             a.speed_hidden, "--batch", str(batch), "--max-steps", str(a.steps), "--lr-schedule",
                             "constant", "--json"], env)
                    times[zero].append(1000.0 * j["train_seconds"] / j["steps"])
            med = {z: statistics.median(t) for z, t in times.items()}
            for z in stages:
                speed["rows"].append({"devices": n, "zero": z, "batch": batch, "median_ms": med[z],
                                      "vs_ddp": med[z] / med[0], "ms_per_step": times[z]})
        report["speed"] = speed
        print(f"\nspeed: 784-{a.speed_hidden.replace(',', '-')}-10, f32 SGD, batch 128 (126 on 3 devices), ms per step, "
              f"median of {a.repeats} alternated runs of {a.steps} steps")
        print("| devices | stage | ms per step | vs DDP | runs |")
        print("| ---: | --- | ---: | ---: | --- |")
        for r in speed["rows"]:
            print(f"| {r['devices']} | {'DDP' if r['zero'] == 0 else 'ZeRO-' + str(r['zero'])} | {r['median_ms']:.2f} | "
                  f"{r['vs_ddp']:.3f}x | {', '.join(f'{t:.2f}' for t in r['ms_per_step'])} |")

    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
