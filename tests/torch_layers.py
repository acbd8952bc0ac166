#!/usr/bin/env python3
"""lockstep's layers against PyTorch's: fixed inputs through torch.nn.functional, the same through lockstep.

This script computes with PyTorch (in float64, from float32 inputs: the reference is the exact result, rounded
once to float32 when stored) each case's outputs, input gradient and parameter
gradients for a fixed output gradient, writes inputs and results to WORKDIR/torch_layers.safetensors (case
parameters in its metadata), and runs the C++ side: `TEST-BINARY --gtest_filter=torch_reference*` with
LOCKSTEP_TORCH_REFERENCE naming the file. The C++ test (tests/test_nn.cpp) runs every case in f32, f16 and bf16 on
each backend and compares per tensor the relative norm of the difference (f32 within 1e-5; f16 and bf16 within
their types' tolerance, against the f32 reference).

Cases (the metadata's "<case>.layer" names the layer, the other keys its options):
  layer_norm_affine  x [4, 3, 16], random weight and bias, eps 1e-5
  layer_norm_plain   x [5, 33], no affine transform, eps 1e-3
  layer_norm_offset  x [3, 64] around 1000 with a spread of 0.01 (the shifted two-pass statistics), eps 1e-5;
                     f32 only (f16 rounds such inputs to steps of 0.5)
  batch_norm_channels  x [6, 4, 3, 3] (BatchNorm2d), momentum 0.1: three training steps (x0, x1, x2; the last one
                       backward with gy), the running statistics after them, then evaluation (xe, gye)
  batch_norm_features  x [8, 5] (BatchNorm1d), no affine transform, momentum 0.3, eps 1e-3: the same
  conv2d_same        x [2, 3, 6, 6], 3 -> 4 channels, kernel 3, padding 1, with bias
  conv2d_strided     x [2, 2, 7, 7], 2 -> 3 channels, kernel 3, stride 2, no bias
  max_pool2d         x [2, 3, 6, 6] (distinct values exact in bf16: no ties after rounding), kernel 2
  avg_pool2d         x [2, 2, 5, 5], kernel 3, stride 2, padding 1
  global_avg_pool2d  x [2, 3, 4, 5] (AdaptiveAvgPool2d(1))

Then the other way: test_nn saves a model with a batch norm (flatten, linear, batch_norm, relu, linear; two training
steps) with save_model; this script loads it into the same torch.nn.Sequential with load_state_dict(strict=True)
and checks that PyTorch's evaluation output for lockstep's input is lockstep's (relative norm within 1e-5).

Usage: tests/torch_layers.py --test-binary build/tests/test_nn --workdir DIR
Exit status: 0 pass, 1 mismatch or error, 77 skipped (no PyTorch; CTest's skip code).
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys

TORCH_PYTHON = "/usr/bin/python3"  # Debian's python3-torch lives there, whatever python3 is first on PATH


def write_f32_safetensors(tensors, metadata, path):
    header, chunks, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        chunks.append(t.detach().contiguous().numpy().astype("<f4").tobytes())
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(chunks[-1])]}
        offset += len(chunks[-1])
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode("ascii") + b"".join(chunks))


def leaf(t):
    """A float64 leaf holding exactly the float32 values of t."""
    return t.float().double().requires_grad_(True)


def layer_norm_case(torch, name, dims, eps, affine, tensors, metadata, offset=0.0, spread=1.0):
    g = torch.Generator().manual_seed(len(tensors) + 1)
    x = leaf(torch.randn(dims, generator=g) * spread + offset)
    features = dims[-1]
    w = leaf(torch.randn(features, generator=g) * 0.5 + 1.0) if affine else None
    b = leaf(torch.randn(features, generator=g) * 0.3) if affine else None
    gy = torch.randn(dims, generator=g).float().double()
    y = torch.nn.functional.layer_norm(x, (features,), w, b, eps)
    y.backward(gy)
    out = {"x": x, "gy": gy, "y": y, "gx": x.grad}
    if affine:
        out.update({"weight": w, "bias": b, "gweight": w.grad, "gbias": b.grad})
    for k, v in out.items():
        tensors[f"{name}.{k}"] = v.detach().float()
    metadata.update({f"{name}.layer": "layer_norm", f"{name}.eps": repr(eps), f"{name}.affine": str(int(affine)),
                     f"{name}.f32_only": str(int(offset != 0.0))})


def batch_norm_case(torch, name, dims, eps, momentum, affine, tensors, metadata):
    g = torch.Generator().manual_seed(len(tensors) + 1)
    channels = dims[1]
    w = leaf(torch.randn(channels, generator=g) * 0.5 + 1.0) if affine else None
    b = leaf(torch.randn(channels, generator=g) * 0.3) if affine else None
    running_mean = torch.zeros(channels, dtype=torch.float64)
    running_var = torch.ones(channels, dtype=torch.float64)
    out = {}
    for step in range(3):
        x = leaf(torch.randn(dims, generator=g) * 2.0 + 0.5)
        y = torch.nn.functional.batch_norm(x, running_mean, running_var, w, b, True, momentum, eps)
        out[f"x{step}"] = x
    gy = torch.randn(dims, generator=g).float().double()
    y.backward(gy)
    out.update({"gy": gy, "y": y, "gx": x.grad, "running_mean": running_mean, "running_var": running_var})
    if affine:
        out.update({"weight": w, "bias": b, "gweight": w.grad, "gbias": b.grad})
        w.grad, b.grad = None, None
    xe = leaf(torch.randn(dims, generator=g))
    gye = torch.randn(dims, generator=g).float().double()
    ye = torch.nn.functional.batch_norm(xe, running_mean, running_var, w, b, False, momentum, eps)
    ye.backward(gye)
    out.update({"xe": xe, "gye": gye, "ye": ye, "gxe": xe.grad})
    if affine:
        out.update({"gweight_e": w.grad, "gbias_e": b.grad})
    for k, v in out.items():
        tensors[f"{name}.{k}"] = v.detach().float()
    metadata.update({f"{name}.layer": "batch_norm", f"{name}.eps": repr(eps), f"{name}.momentum": repr(momentum),
                     f"{name}.affine": str(int(affine)), f"{name}.f32_only": "0"})


def window_case(torch, name, layer, dims, tensors, metadata, **options):
    """conv2d, max_pool2d, avg_pool2d or global_avg_pool2d on x of `dims`; options as in PyTorch's functions."""
    g = torch.Generator().manual_seed(len(tensors) + 1)
    if layer == "max_pool2d":  # a permutation of 0, 1/8, 2/8, ...: distinct, and exact in f16 and bf16
        x = leaf(torch.randperm(math.prod(dims), generator=g).reshape(dims).float() / 8)
    else:
        x = leaf(torch.randn(dims, generator=g))
    out = {"x": x}
    meta = {"layer": layer}
    if layer == "conv2d":
        k, cout = options["kernel"], options["out_channels"]
        bound = 1.0 / math.sqrt(dims[1] * k * k)
        w = leaf((torch.rand([cout, dims[1], k, k], generator=g) * 2 - 1) * bound)
        b = leaf((torch.rand([cout], generator=g) * 2 - 1) * bound) if options["bias"] else None
        y = torch.nn.functional.conv2d(x, w, b, stride=options["stride"], padding=options["padding"])
        out["weight"] = w
        if b is not None:
            out["bias"] = b
        meta.update({"out_channels": cout, "kernel": k, "stride": options["stride"], "padding": options["padding"],
                     "affine": int(options["bias"])})
    elif layer == "max_pool2d":
        y = torch.nn.functional.max_pool2d(x, options["kernel"])
        meta.update({"kernel": options["kernel"], "stride": options["kernel"], "padding": 0})
    elif layer == "avg_pool2d":
        y = torch.nn.functional.avg_pool2d(x, options["kernel"], options["stride"], options["padding"])
        meta.update({"kernel": options["kernel"], "stride": options["stride"], "padding": options["padding"]})
    else:
        y = torch.nn.functional.adaptive_avg_pool2d(x, 1)
    gy = torch.randn(y.shape, generator=g).float().double()
    y.backward(gy)
    out.update({"gy": gy, "y": y, "gx": x.grad})
    if layer == "conv2d":
        out["gweight"] = out["weight"].grad
        if "bias" in out:
            out["gbias"] = out["bias"].grad
    for k, v in out.items():
        tensors[f"{name}.{k}"] = v.detach().float()
    meta.setdefault("affine", 0)
    meta["f32_only"] = 0
    metadata.update({f"{name}.{k}": str(v) for k, v in meta.items()})


SAFETENSORS_TYPES = {"F32": "<f4", "I64": "<i8"}


def read_safetensors(torch, path):
    import numpy as np
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    out = {}
    for name, t in json.loads(blob[8:8 + n]).items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        a = np.frombuffer(blob[8 + n + begin:8 + n + end], dtype=SAFETENSORS_TYPES[t["dtype"]])
        out[name] = torch.from_numpy(a.astype(a.dtype.newbyteorder("="), copy=True).reshape(t["shape"]))
    return out


def check_saved_models(torch, workdir):
    """PyTorch loads each bn_model.<backend>.safetensors test_nn wrote, strictly, and evaluates as lockstep did."""
    checked = 0
    for backend in ("host", "cuda"):
        model_file = os.path.join(workdir, f"bn_model.{backend}.safetensors")
        if not os.path.exists(model_file):
            continue
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6), torch.nn.BatchNorm1d(6),
                                    torch.nn.ReLU(), torch.nn.Linear(6, 3))
        model.load_state_dict(read_safetensors(torch, model_file), strict=True)
        model.eval()
        io = read_safetensors(torch, os.path.join(workdir, f"bn_model_io.{backend}.safetensors"))
        with torch.no_grad():
            got = model(io["input"].double().reshape(5, 3, 4).float())
        diff = float((got - io["output"]).norm() / io["output"].norm())
        print(f"torch_layers: {backend}: PyTorch loaded {model_file} strictly (num_batches_tracked "
              f"{int(model[2].num_batches_tracked)}); its output differs from lockstep's by {diff:.3g}")
        if diff > 1e-5 or int(model[2].num_batches_tracked) != 2:
            print("torch_layers: FAIL: the saved model does not evaluate as it did in lockstep")
            return False
        checked += 1
    if checked == 0:
        print("torch_layers: FAIL: test_nn wrote no model")
        return False
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--test-binary", required=True)
    p.add_argument("--workdir", required=True)
    a = p.parse_args()
    try:
        import torch
    except ImportError:
        if os.path.exists(TORCH_PYTHON) and os.path.realpath(sys.executable) != os.path.realpath(TORCH_PYTHON):
            os.execv(TORCH_PYTHON, [TORCH_PYTHON] + sys.argv)
        print("torch_layers: PyTorch is not installed (Debian python3-torch; scripts/setup.sh --torch installs it): "
              "skipped")
        return 77
    torch.set_num_threads(1)
    tensors, metadata = {}, {}
    layer_norm_case(torch, "layer_norm_affine", [4, 3, 16], 1e-5, True, tensors, metadata)
    layer_norm_case(torch, "layer_norm_plain", [5, 33], 1e-3, False, tensors, metadata)
    layer_norm_case(torch, "layer_norm_offset", [3, 64], 1e-5, True, tensors, metadata, offset=1000.0, spread=0.01)
    batch_norm_case(torch, "batch_norm_channels", [6, 4, 3, 3], 1e-5, 0.1, True, tensors, metadata)
    batch_norm_case(torch, "batch_norm_features", [8, 5], 1e-3, 0.3, False, tensors, metadata)
    window_case(torch, "conv2d_same", "conv2d", [2, 3, 6, 6], tensors, metadata, out_channels=4, kernel=3, stride=1,
                padding=1, bias=True)
    window_case(torch, "conv2d_strided", "conv2d", [2, 2, 7, 7], tensors, metadata, out_channels=3, kernel=3, stride=2,
                padding=0, bias=False)
    window_case(torch, "max_pool2d", "max_pool2d", [2, 3, 6, 6], tensors, metadata, kernel=2)
    window_case(torch, "avg_pool2d", "avg_pool2d", [2, 2, 5, 5], tensors, metadata, kernel=3, stride=2, padding=1)
    window_case(torch, "global_avg_pool2d", "global_avg_pool2d", [2, 3, 4, 5], tensors, metadata)
    os.makedirs(a.workdir, exist_ok=True)
    path = os.path.join(a.workdir, "torch_layers.safetensors")
    write_f32_safetensors(tensors, metadata, path)
    cases = sum(k.endswith(".layer") for k in metadata)
    print(f"torch_layers: PyTorch {torch.__version__}, {cases} cases in {path}", flush=True)
    env = dict(os.environ, LOCKSTEP_TORCH_REFERENCE=path)
    for stale in os.listdir(a.workdir):
        if stale.startswith("bn_model"):
            os.remove(os.path.join(a.workdir, stale))
    rc = subprocess.run([a.test_binary, "--gtest_filter=*torch_reference*"], env=env).returncode
    if rc != 0:
        return rc
    return 0 if check_saved_models(torch, a.workdir) else 1


if __name__ == "__main__":
    sys.exit(main())
