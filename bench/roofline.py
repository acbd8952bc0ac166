#!/usr/bin/python3
"""The sample's training step against the machine's limit: the step's FLOP rate next to its roofline.

For each model, precision and mode, alternated run by run (this machine drifts by 30%):
  - `mlp_train --json` trains --steps steps (constant rate) and reports samples per second;
  - `bench_roofline --json` measures the step's own GEMM shapes (rows per device = batch / devices) with every
    kernel this machine has and gives the best single-core rate: the roofline, per device.
The step's rate is samples/s x the GEMM FLOPs of a sample (forward, weight gradients, input gradients of all but
the first layer); the ratio to the roofline (x devices) is how close the step comes to the machine's GEMM limit.
Medians over --repeats.

    python3 bench/roofline.py [--build build/release] [--hidden 1024,1024 256,256] [--precisions f32 f16 bf16]
                              [--modes single ddp] [--repeats 5] [--steps 300] [--json FILE]

Prints a Markdown table (docs/benchmarks.md keeps it) and the CPU it ran on (lscpu's model name and flags that
matter).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd, env=None):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"roofline.py: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_name():
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name"))
        flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("Flags"))
        wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
        return f"{model} ({' '.join(wanted)})"
    except (OSError, StopIteration):
        return "unknown CPU"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(here, "..", "build", "rel"))
    p.add_argument("--hidden", nargs="+", default=["1024,1024", "256,256"])
    p.add_argument("--precisions", nargs="+", default=["f32", "f16", "bf16"])
    p.add_argument("--modes", nargs="+", default=["single", "ddp"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seconds", type=float, default=0.1, help="bench_roofline's time per shape and kernel")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    sample = os.path.join(a.build, "examples", "mlp_train", "mlp_train")
    roofline = os.path.join(a.build, "bench", "bench_roofline")
    env = dict(os.environ, LOCKSTEP_HOST_DEVICES="2")

    configs = [(h, prec, mode) for h in a.hidden for prec in a.precisions for mode in a.modes]
    samples = {c: [] for c in configs}
    limits = {c: [] for c in configs}
    kernels = ""
    for r in range(a.repeats):
        for c in configs:
            hidden, prec, mode = c
            devices = 2 if mode == "ddp" else 1
            cmd = [sample, "--hidden", hidden, "--precision", prec, "--batch", str(a.batch), "--max-steps",
                   str(a.steps), "--lr-schedule", "constant", "--epochs", "1", "--json", "--mode", mode]
            if mode == "ddp":
                cmd += ["--devices", "host:0,host:1"]
            samples[c].append(run_json(cmd, env)["samples_per_second"])
            lim = run_json([roofline, "--hidden", hidden, "--precision", prec, "--batch", str(a.batch),
                            "--devices", str(devices), "--seconds", str(a.seconds), "--json"], env)
            limits[c].append(lim)
            kernels = lim["kernels"]
        print(f"round {r + 1} of {a.repeats} done", file=sys.stderr)

    rows = []
    for c in configs:
        hidden, prec, mode = c
        flops = limits[c][0]["gemm_flops_per_sample"]
        sps = statistics.median(samples[c])
        roof_sps = statistics.median(x["roofline_samples_per_second"] for x in limits[c])
        roof_gflops = statistics.median(x["roofline_gflops_per_device"] for x in limits[c])
        rows.append({"hidden": hidden, "precision": prec, "mode": mode, "samples_per_second": sps,
                     "step_gflops": sps * flops / 1e9, "roofline_gflops_per_device": roof_gflops,
                     "roofline_samples_per_second": roof_sps, "ratio": sps / roof_sps,
                     "samples_per_second_all": samples[c]})

    print(f"CPU: {cpu_name()}; kernels: {kernels}")
    print(f"batch {a.batch}, {a.steps} steps, medians of {a.repeats} alternated runs\n")
    print("| model | precision | mode | samples/s | step GFLOP/s | roofline GFLOP/s per device | of the roofline |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        mode = "DDP on 2" if row["mode"] == "ddp" else "one device"
        print(f"| 784-{row['hidden'].replace(',', '-')}-10 | {row['precision']} | {mode} | "
              f"{row['samples_per_second']:,.0f} | {row['step_gflops']:.1f} | {row['roofline_gflops_per_device']:.1f} | "
              f"**{row['ratio']:.2f}** |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "kernels": kernels, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
