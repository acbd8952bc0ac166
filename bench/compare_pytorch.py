#!/usr/bin/env python3
"""Side-by-side training throughput: lockstep's samples (examples/mlp_train, examples/cnn_train) against PyTorch on
the CPU.

Both train the same MLP (784-H-H-10, ReLU) on Fashion-MNIST with the same batch and optimizer (SGD lr 0.05
momentum 0.9 unless told otherwise), for the same number of steps, on the same machine, in one run: the two
sides alternate (lockstep, PyTorch, lockstep, PyTorch, ...) so that a noisy neighbour slows both, and the
reported figure is the median of each side's runs and the ratio of the medians.

    single   lockstep on one host device (one core computes, as one GPU is one device; data loader workers
             on other threads) against PyTorch pinned to one core (taskset -c 0, torch.set_num_threads(1),
             DataLoader in the training thread).
    ddp      lockstep --mode ddp on 2 host devices against PyTorch DistributedDataParallel with the gloo backend
             on 2 processes (one thread each), both with the same global batch; and, alternated with them,
             lockstep on one host device, for lockstep's own speed-up from the second device (ddp_over_single).
    accuracy not a speed: the test accuracy after --epochs full epochs (default 5) of the sample's recipe, for
             each of --seeds and each of --schedules (cosine: the rate anneals from --lr to 0 over the run,
             stepped every batch, PyTorch's CosineAnnealingLR; constant: --lr throughout), lockstep on one
             host device against PyTorch on one thread. The seeds differ between the two (different random
             generators), so compare the means and spreads, not seed by seed.

The speed modes run both sides with a constant learning rate, in --precision: f32, or bf16 (lockstep's bf16 with
fp32 master weights against PyTorch's torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss, its
mixed precision on CPUs), or f16 (lockstep only: PyTorch 1.13 has no f16 autocast on CPUs, so its side runs f32
and the row says so). --torch-env VAR=VALUE sets a variable for the PyTorch side only (OPENBLAS_CORETYPE=SkylakeX
gives it the right OpenBLAS kernels on a CPU its OpenBLAS does not know).

--model cnn compares cnn_train instead (examples/cnn_train/model.hpp, built in PyTorch by torch_cnn with the same
layers and names: --channels 32,64, --hidden 128, --dropout 0.5 by default). Its ddp mode uses plain batch norm on
both sides (PyTorch 1.13's SyncBatchNorm runs on GPUs only).

Usage: bench/compare_pytorch.py [--sample PATH] [--model mlp|cnn] [--hidden 256,256 1024,1024] [--channels 32,64]
                                [--dropout P] [--steps N] [--repeats R]
                                [--modes single ddp accuracy] [--epochs N] [--seeds 0 1 2]
                                [--schedules cosine constant] [--precision f32|bf16|f16]
                                [--torch-env VAR=VALUE ...] [--json]
PyTorch is Debian's python3-torch (scripts/setup.sh --torch); without it the comparison is skipped with a
message (exit code 0).
"""
import argparse
import gzip
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

DATA = "/usr/share/datasets/fashion-mnist"
# Debian's python3-torch is installed for the system interpreter, which may not be the first python3 on PATH.
TORCH_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def read_idx(path):
    import numpy as np
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype, rank = struct.unpack(">HBB", data[:4])
    dims = struct.unpack(">" + "I" * rank, data[4:4 + 4 * rank])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


# ---- the PyTorch side (runs in a child process) -----------------------------------------------------------------

def torch_model(hidden):
    import torch
    layers, width = [], 784
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def torch_cnn(channels=(32, 64), hidden=(128,), dropout=0.5, sync_bn=False):
    """examples/cnn_train's model (its model.hpp), with its graph's names: image, [conv, bn, act, pool] per channel
    count, flat, [fc, relu, drop] per hidden width, out. The convolutions have no bias."""
    import collections
    import torch
    layers, side, width = [("image", torch.nn.Unflatten(1, (1, 28, 28)))], 28, 1
    for i, c in enumerate(channels, 1):
        layers += [(f"conv{i}", torch.nn.Conv2d(width, c, 3, padding=1, bias=False)),
                   (f"bn{i}", torch.nn.SyncBatchNorm(c) if sync_bn else torch.nn.BatchNorm2d(c)),
                   (f"act{i}", torch.nn.ReLU()), (f"pool{i}", torch.nn.MaxPool2d(2))]
        width, side = c, side // 2
    layers.append(("flat", torch.nn.Flatten()))
    width *= side * side
    for i, h in enumerate(hidden, 1):
        layers += [(f"fc{i}", torch.nn.Linear(width, h)), (f"relu{i}", torch.nn.ReLU())]
        if dropout > 0:
            layers.append((f"drop{i}", torch.nn.Dropout(dropout)))
        width = h
    layers.append(("out", torch.nn.Linear(width, 10)))
    return torch.nn.Sequential(collections.OrderedDict(layers))


def build_torch_model(model):
    """The model of a spec {"kind": "mlp" | "cnn", "hidden": [...], "channels": [...], "dropout": p} (model_spec)."""
    if model["kind"] == "cnn":
        return torch_cnn(model["channels"], model["hidden"], model["dropout"])
    return torch_model(model["hidden"])


def torch_loader(batch, seed, rank=0, world=1):
    import torch
    images = torch.from_numpy(read_idx(os.path.join(DATA, "train-images-idx3-ubyte.gz")).reshape(-1, 784).copy())
    labels = torch.from_numpy(read_idx(os.path.join(DATA, "train-labels-idx1-ubyte.gz")).astype("int64"))
    dataset = torch.utils.data.TensorDataset(images, labels)
    if world > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank, seed=seed)
        return torch.utils.data.DataLoader(dataset, batch_size=batch // world, sampler=sampler, num_workers=0)
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, generator=generator, num_workers=0)


def torch_train(model_spec, batch, steps, lr, momentum, rank=0, world=1, precision="f32"):
    """Trains `steps` steps; returns samples per second (global) measured after a warm-up of 10 steps."""
    import contextlib
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_torch_model(model_spec)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = torch_loader(batch, 0, rank, world)
    done, samples, start = 0, 0, None
    while done < steps + 10:
        for x, y in loader:
            if done == 10:
                start, samples = time.perf_counter(), 0
            x = x.float().div_(255.0)
            opt.zero_grad()
            autocast = (torch.autocast(device_type="cpu", dtype=torch.bfloat16) if precision == "bf16"
                        else contextlib.nullcontext())
            with autocast:
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            done += 1
            samples += x.shape[0] * world
            if done >= steps + 10:
                break
    return samples / (time.perf_counter() - start)


def torch_accuracy(model_spec, batch, epochs, lr, momentum, schedule, seed):
    """Trains `epochs` epochs from seed `seed` (initialization and shuffling); returns the test accuracy."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = build_torch_model(model_spec)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loader = torch_loader(batch, seed)
    sched = None
    if schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(loader))
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x.float().div_(255.0)), y).backward()
            opt.step()
            if sched:
                sched.step()
    images = torch.from_numpy(read_idx(os.path.join(DATA, "t10k-images-idx3-ubyte.gz")).reshape(-1, 784).copy())
    labels = torch.from_numpy(read_idx(os.path.join(DATA, "t10k-labels-idx1-ubyte.gz")).astype("int64"))
    model.eval()
    with torch.no_grad():
        predicted = torch.cat([model(images[i:i + 1000].float().div_(255.0)).argmax(dim=1)
                               for i in range(0, len(images), 1000)])
    return (predicted == labels).float().mean().item()


def torch_ddp_worker(rank, world, port, args, queue):
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rate = torch_train(args["model"], args["batch"], args["steps"], args["lr"], args["momentum"], rank, world,
                       args.get("precision", "f32"))
    dist.barrier()
    if rank == 0:
        queue.put(rate)
    dist.destroy_process_group()


def torch_child(spec):
    """Entry point of the PyTorch child process: prints one JSON line."""
    if spec["mode"] == "accuracy":
        acc = torch_accuracy(spec["model"], spec["batch"], spec["epochs"], spec["lr"], spec["momentum"],
                             spec["schedule"], spec["seed"])
        print(json.dumps({"test_accuracy": acc}))
        return
    if spec["mode"] == "single":
        rate = torch_train(spec["model"], spec["batch"], spec["steps"], spec["lr"], spec["momentum"],
                           precision=spec.get("precision", "f32"))
    else:
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = 29500 + os.getpid() % 1000
        procs = [ctx.Process(target=torch_ddp_worker, args=(r, 2, port, spec, queue)) for r in range(2)]
        for p in procs:
            p.start()
        rate = queue.get(timeout=600)
        for p in procs:
            p.join()
    print(json.dumps({"samples_per_second": rate}))


# ---- the driver ----------------------------------------------------------------------------------------------------

def model_options(model):
    """The sample's command-line options for a model spec."""
    args = ["--hidden", ",".join(map(str, model["hidden"]))]
    if model["kind"] == "cnn":
        args += ["--channels", ",".join(map(str, model["channels"])), "--dropout", str(model["dropout"])]
    return args


def run_sample(binary, model, batch, lr, momentum, extra):
    """Runs the sample with --json and the recipe's options, plus `extra`; returns its JSON summary."""
    args = [binary, "--json", "--batch", str(batch), "--lr", str(lr), "--momentum", str(momentum)]
    args += model_options(model) + extra
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def run_lockstep(binary, mode, model, batch, steps, lr, momentum, precision="f32"):
    extra = ["--max-steps", str(steps), "--epochs", "100", "--print-every", "1000000", "--eval-batch", "1000",
             "--lr-schedule", "constant", "--precision", precision]
    if mode == "single":
        extra += ["--devices", "host:0"]
    else:
        extra += ["--mode", "ddp", "--devices", "host:0,host:1"]
    return run_sample(binary, model, batch, lr, momentum, extra)["samples_per_second"]


def lockstep_accuracy(binary, model, batch, epochs, lr, momentum, schedule, seed):
    extra = ["--epochs", str(epochs), "--lr-schedule", schedule, "--seed", str(seed), "--devices", "host:0"]
    return run_sample(binary, model, batch, lr, momentum, extra)["test_accuracy"]


TORCH_ENV = {}  # --torch-env


def torch_run(spec, pin):
    cmd = [TORCH_PYTHON, os.path.abspath(__file__), "--torch-child", json.dumps(spec)]
    if pin and shutil.which("taskset"):
        cmd = ["taskset", "-c", "0"] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **TORCH_ENV)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
    return json.loads(out)


def compare_accuracy(a, hidden_spec):
    """The accuracy mode: one result per schedule."""
    model = model_spec(a, hidden_spec)
    results = []
    for schedule in a.schedules:
        ours, theirs = [], []
        for seed in a.seeds:
            ours.append(lockstep_accuracy(a.mlp_train, model, a.batch, a.epochs, a.lr, a.momentum, schedule, seed))
            theirs.append(torch_run({"mode": "accuracy", "model": model, "batch": a.batch, "epochs": a.epochs,
                                     "lr": a.lr, "momentum": a.momentum, "schedule": schedule, "seed": seed},
                                    pin=False)["test_accuracy"])
        r = {"mode": "accuracy", "model": model_name(model), "hidden": hidden_spec, "batch": a.batch, "epochs": a.epochs, "lr": a.lr,
             "momentum": a.momentum, "schedule": schedule, "seeds": a.seeds, "lockstep_accuracy": ours,
             "pytorch_accuracy": theirs, "lockstep_mean": statistics.mean(ours), "pytorch_mean": statistics.mean(theirs),
             "lockstep_min": min(ours), "pytorch_min": min(theirs)}
        results.append(r)
        if not a.json:
            fmt = lambda v: " ".join(f"{x:.4f}" for x in v)
            print(f"accuracy {model_name(model)} batch {a.batch} {a.epochs} epochs, lr {a.lr} {schedule:8s}:"
                  f" lockstep mean {r['lockstep_mean']:.4f} min {r['lockstep_min']:.4f} [{fmt(ours)}];"
                  f" PyTorch mean {r['pytorch_mean']:.4f} min {r['pytorch_min']:.4f} [{fmt(theirs)}]"
                  f"  (seeds {' '.join(map(str, a.seeds))})")
    return results


def run_torch(mode, model, batch, steps, lr, momentum, precision="f32"):
    spec = {"mode": mode, "model": model, "batch": batch, "steps": steps, "lr": lr, "momentum": momentum,
            "precision": "bf16" if precision == "bf16" else "f32"}
    return torch_run(spec, pin=mode == "single")["samples_per_second"]


def model_spec(a, hidden_spec):
    """The model the arguments describe, for one of --hidden's entries."""
    return {"kind": a.model, "hidden": [int(h) for h in hidden_spec.split(",")],
            "channels": [int(c) for c in a.channels.split(",")], "dropout": a.dropout}


def model_name(model):
    if model["kind"] == "cnn":
        return (f"cnn channels {','.join(map(str, model['channels']))} hidden "
                f"{','.join(map(str, model['hidden']))} dropout {model['dropout']}")
    return f"mlp hidden {','.join(map(str, model['hidden'])):10s}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample", "--mlp-train", dest="mlp_train",
                   help="the sample's binary (default: build/sample/examples/mlp_train/mlp_train, or cnn_train's with "
                        "--model cnn)")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                   help="mlp (mlp_train's) or cnn (cnn_train's: conv-BN-ReLU-pool blocks, fc-ReLU-dropout, out)")
    p.add_argument("--hidden", nargs="+", help="hidden widths, one run each (default 256,256 1024,1024; cnn: 128)")
    p.add_argument("--channels", default="32,64", help="--model cnn: the convolutions' channels")
    p.add_argument("--dropout", type=float, default=0.5, help="--model cnn: dropout after the hidden layers")
    p.add_argument("--modes", nargs="+", default=["single", "ddp"], choices=["single", "ddp", "accuracy"])
    p.add_argument("--epochs", type=int, default=5, help="accuracy mode: full epochs")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="accuracy mode")
    p.add_argument("--schedules", nargs="+", default=["cosine", "constant"], choices=["cosine", "constant"],
                   help="accuracy mode")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16"], help="speed modes")
    p.add_argument("--torch-env", nargs="*", default=[], help="VAR=VALUE for the PyTorch side only")
    p.add_argument("--json", action="store_true")
    p.add_argument("--torch-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.hidden is None:
        a.hidden = ["128"] if a.model == "cnn" else ["256,256", "1024,1024"]
    if a.mlp_train is None:
        sample = "cnn_train" if a.model == "cnn" else "mlp_train"
        a.mlp_train = os.path.join(ROOT, "build", "sample", "examples", sample, sample)
    for kv in a.torch_env:
        var, _, value = kv.partition("=")
        TORCH_ENV[var] = value
    if a.torch_child:
        torch_child(json.loads(a.torch_child))
        return 0

    probe = subprocess.run([TORCH_PYTHON, "-c", "import torch, numpy"], capture_output=True)
    if probe.returncode != 0:
        print("compare_pytorch: PyTorch is not installed (Debian python3-torch; scripts/setup.sh --torch installs it): "
              "comparison skipped")
        return 0
    if not os.path.exists(a.mlp_train):
        print(f"compare_pytorch: {a.mlp_train} does not exist; build it first (scripts/run-sample.sh --help builds it)")
        return 1

    cores = os.cpu_count()
    results = []
    for mode in a.modes:
        for hidden_spec in a.hidden:
            if mode == "accuracy":
                results += compare_accuracy(a, hidden_spec)
                continue
            model = model_spec(a, hidden_spec)
            ours, theirs, ours_single = [], [], []
            for _ in range(a.repeats):
                if mode == "ddp":
                    ours_single.append(run_lockstep(a.mlp_train, "single", model, a.batch, a.steps, a.lr, a.momentum,
                                                    a.precision))
                ours.append(run_lockstep(a.mlp_train, mode, model, a.batch, a.steps, a.lr, a.momentum, a.precision))
                theirs.append(run_torch(mode, model, a.batch, a.steps, a.lr, a.momentum, a.precision))
            r = {
                "mode": mode,
                "model": model_name(model),
                "hidden": hidden_spec,
                "batch": a.batch,
                "steps": a.steps,
                "precision": a.precision,
                "pytorch_precision": "bf16 autocast" if a.precision == "bf16" else "f32",
                "pytorch_env": TORCH_ENV,
                "lockstep_samples_per_second": statistics.median(ours),
                "pytorch_samples_per_second": statistics.median(theirs),
                "lockstep_runs": ours,
                "pytorch_runs": theirs,
                "lockstep_setup": ("1 host device computing on 1 core; data loader workers on other threads"
                                   if mode == "single" else "2 host devices (1 compute core each) in one process"),
                "pytorch_setup": ("taskset -c 0, torch.set_num_threads(1), DataLoader num_workers=0"
                                  if mode == "single" else "DistributedDataParallel, gloo, 2 processes x 1 thread"),
                "machine_cores": cores,
            }
            r["ratio"] = r["lockstep_samples_per_second"] / r["pytorch_samples_per_second"]
            if ours_single:
                r["lockstep_single_runs"] = ours_single
                r["ddp_over_single"] = r["lockstep_samples_per_second"] / statistics.median(ours_single)
            results.append(r)
            if not a.json:
                print(f"{mode:6s} {a.precision} {model_name(model)} batch {a.batch}: lockstep {r['lockstep_samples_per_second']:9.0f}"
                      f" samples/s, PyTorch {r['pytorch_samples_per_second']:9.0f} samples/s, ratio {r['ratio']:.2f}"
                      f"  (medians of {a.repeats}, alternated)")
                if ours_single:
                    print(f"{'':6s} {model_name(model)} batch {a.batch}: lockstep ddp on 2 devices against 1 device:"
                          f" {r['ddp_over_single']:.2f}x (1 device: {statistics.median(ours_single):.0f} samples/s)")
    if not a.json:
        print(f"machine: {cores} cores.")
        for mode in a.modes:
            if mode == "accuracy":
                print("accuracy: lockstep 1 host device; PyTorch 1 thread.")
                continue
            r = next((r for r in results if r["mode"] == mode), None)
            if r:
                print(f"{mode}: lockstep {r['lockstep_setup']}; PyTorch {r['pytorch_setup']}.")
    else:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
