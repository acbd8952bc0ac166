#!/usr/bin/env python3
"""Checkpoint interoperability between lockstep's samples (examples/mlp_train, examples/cnn_train) and PyTorch, in
both directions. --model mlp (default) or cnn chooses the sample; "mlp_train" below is either.

lockstep -> PyTorch: mlp_train trains --steps steps and saves a checkpoint (--save); its model.safetensors is
loaded into the equivalent torch.nn model (fc1.weight, fc1.bias, ..., out.weight, out.bias; for the CNN also
conv1.weight, bn1.weight, bn1.bias and the batch norms' buffers bn1.running_mean, bn1.running_var and
bn1.num_batches_tracked) with load_state_dict(strict=True) and evaluated on the Fashion-MNIST test set.
PyTorch's count of correct answers must equal mlp_train's test_correct, and both the SHA-256 of the file's data
section and that of the loaded tensors (in lockstep's order: 8-byte buffers, parameters, other buffers) must
equal its weights_sha256.

PyTorch -> lockstep: the same model, trained in PyTorch (seed 0, --steps SGD steps, batch 128, lr 0.05,
momentum 0.9; batch norm in training mode, dropout on), is saved as safetensors twice: with plain names and with nn.DataParallel's "module." prefix.
`mlp_train --load-model FILE --epochs 0` evaluates each; it must count PyTorch's correct answers and report the
SHA-256 of PyTorch's parameters as weights_sha256.

The inputs match lockstep's bit for bit: the IDX reader, the model's construction and the pixel scaling
(x.float().div_(255.0), a correctly rounded float32 division like mnist_dataset::fetch's pixel / 255.0f in
include/lockstep/data/idx.hpp) come from bench/compare_pytorch.py, and the scaling is checked against numpy's
float32 division for all 256 pixel values. The counts may still differ where two logits tie to within the
rounding of the two GEMMs (OpenBLAS, PyTorch's): --tolerance N accepts N answers of difference.

Usage: /usr/bin/python3 tools/safetensors_interop.py --sample build/sample/examples/mlp_train/mlp_train
           [--model mlp|cnn] [--hidden 128] [--channels 32,64] [--dropout 0.5] [--steps 200] [--data DIR]
           [--tolerance 0] [--devices host:0] [--workdir DIR]
           [--train-options "--mode ddp --zero 2 --devices host:0,host:1"]
Exit status: 0 pass, 1 mismatch or error, 77 skipped (no PyTorch or no dataset; CTest's skip code).
"""
import argparse
import collections
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import compare_pytorch as cp  # noqa: E402  read_idx, torch_model, TORCH_PYTHON

BATCH, LR, MOMENTUM, SEED = 128, 0.05, 0.9, 0
FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz"]
KEYS = ["test_accuracy", "test_correct", "test_samples", "weights_sha256"]
TEST_IMAGES = 10000


class Failure(Exception):
    pass


# ---- safetensors: the package when importable, else this reader/writer of the format -------------------------------

NUMPY_TYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1"}
WRITTEN_TYPES = {"torch.float32": ("F32", "<f4"), "torch.int64": ("I64", "<i8")}


def read_safetensors(path):
    import numpy as np
    import torch
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, t in json.loads(blob[8:8 + n]).items():
        if name == "__metadata__":
            continue
        if t["dtype"] not in NUMPY_TYPES:
            raise Failure(f"{path}: tensor {name} has dtype {t['dtype']}, which the built-in reader does not read")
        begin, end = t["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=NUMPY_TYPES[t["dtype"]])
        if end > len(data) or a.size != math.prod(t["shape"]):
            raise Failure(f"{path}: tensor {name}: data_offsets {t['data_offsets']} do not hold shape {t['shape']}")
        out[name] = torch.from_numpy(a.astype(a.dtype.newbyteorder("="), copy=True).reshape(t["shape"]))
    return out


def write_safetensors(tensors, path):
    import torch
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        if str(t.dtype) not in WRITTEN_TYPES:
            raise Failure(f"the built-in writer writes F32 and I64 only; {name} is {t.dtype}")
        kind, layout = WRITTEN_TYPES[str(t.dtype)]
        chunks.append(t.detach().cpu().contiguous().numpy().astype(layout).tobytes())
        header[name] = {"dtype": kind, "shape": list(t.shape), "data_offsets": [offset, offset + len(chunks[-1])]}
        offset += len(chunks[-1])
    text = json.dumps(header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode("ascii") + b"".join(chunks))


def safetensors_io():
    """(load, save, description): safetensors.torch when importable, else the built-in functions above."""
    try:
        import safetensors
        from safetensors.torch import load_file, save_file
    except ImportError:
        return read_safetensors, write_safetensors, "built-in reader/writer (the safetensors package is not installed)"
    return load_file, lambda t, p: save_file(t, p, metadata={"format": "pt"}), \
        f"the safetensors package {getattr(safetensors, '__version__', '?')}"


def data_section_sha256(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n)
        return hashlib.sha256(f.read()).hexdigest()


def lockstep_order(model):
    """A module's tensors in the order of lockstep's model file and weights_sha256 (detail::for_each_model_tensor):
    the 8-byte buffers (num_batches_tracked), the parameters, the other buffers (running_mean, running_var)."""
    buffers = list(model.named_buffers())
    return [b for b in buffers if b[1].element_size() == 8] + list(model.named_parameters()) + \
        [b for b in buffers if b[1].element_size() != 8]


def parameters_sha256(model):
    """lockstep's weights_sha256 of a module: its tensors' bytes, little-endian, in lockstep_order."""
    h = hashlib.sha256()
    for _, t in lockstep_order(model):
        values = t.detach().cpu().contiguous().numpy()
        h.update(values.astype(values.dtype.newbyteorder("<")).tobytes())
    return h.hexdigest()


# ---- the PyTorch side ---------------------------------------------------------------------------------------------

def model_spec(a):
    """compare_pytorch's description of the model the arguments name."""
    return {"kind": a.model, "hidden": [int(h) for h in a.hidden.split(",")],
            "channels": [int(c) for c in a.channels.split(",")], "dropout": a.dropout}


def build_model(a, hidden):
    """The sample's model in PyTorch, named like its graph's nodes. MLP: compare_pytorch.torch_model's layers (same
    construction, so the same initialization under a seed): fc1, relu1, fc2, relu2, ..., out. CNN:
    compare_pytorch.torch_cnn (cnn_train's model.hpp)."""
    import torch
    if a.model == "cnn":
        return cp.build_torch_model(model_spec(a))
    names = [n for i in range(len(hidden)) for n in (f"fc{i + 1}", f"relu{i + 1}")] + ["out"]
    return torch.nn.Sequential(collections.OrderedDict(zip(names, cp.torch_model(hidden))))


def to_input(images):
    """u8 pixels -> f32 in [0, 1], as compare_pytorch.py does (x.float().div_(255.0))."""
    return images.float().div_(255.0)


def check_scaling():
    import numpy as np
    import torch
    got = to_input(torch.arange(256).to(torch.uint8)).numpy()
    want = np.arange(256, dtype=np.float32) / np.float32(255.0)  # correctly rounded, as in mnist_dataset::fetch
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        raise Failure("PyTorch's x.float().div_(255.0) differs from the float32 division pixel / 255.0f")


def load_split(data, prefix):
    """As in compare_pytorch.py: u8 images [n, 784] and int64 labels."""
    import torch
    images = cp.read_idx(os.path.join(data, f"{prefix}-images-idx3-ubyte.gz")).reshape(-1, 784).copy()
    labels = cp.read_idx(os.path.join(data, f"{prefix}-labels-idx1-ubyte.gz")).astype("int64")
    return torch.from_numpy(images), torch.from_numpy(labels)


def evaluate(model, test, batch=1000):
    """(correct answers, logits) on the test set; argmax takes the first maximum, as lockstep's accuracy does."""
    import torch
    images, labels = test
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(to_input(images[i:i + batch])) for i in range(0, len(images), batch)])
    return int((logits.argmax(dim=1) == labels).sum()), logits


def train(model, train_set, steps):
    import torch
    images, labels = train_set
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn, generator, done = torch.nn.CrossEntropyLoss(), torch.Generator().manual_seed(SEED), 0
    model.train()
    while done < steps:
        order = torch.randperm(len(images), generator=generator)
        for i in range(0, len(order) - BATCH + 1, BATCH):
            opt.zero_grad()
            loss_fn(model(to_input(images[order[i:i + BATCH]])), labels[order[i:i + BATCH]]).backward()
            opt.step()
            done += 1
            if done == steps:
                break


# ---- the checks ---------------------------------------------------------------------------------------------------

def run_mlp_train(a, extra):
    cmd = [a.mlp_train, "--json", "--data", a.data] + cp.model_options(model_spec(a))
    cmd += (["--devices", a.devices] if a.devices else []) + extra
    print("  $ " + " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    except subprocess.CalledProcessError as e:
        raise Failure(f"mlp_train exited with status {e.returncode}; its stderr:\n{e.stderr.strip()}") from None
    except subprocess.TimeoutExpired:
        raise Failure("mlp_train did not finish within an hour") from None
    try:
        r = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise Failure(f"mlp_train's last line of output is not JSON:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}") from None
    if [k for k in KEYS if k not in r]:
        raise Failure(f"mlp_train's JSON lacks {[k for k in KEYS if k not in r]}")
    if r["test_samples"] != TEST_IMAGES:
        raise Failure(f"mlp_train tested {r['test_samples']} images, not the {TEST_IMAGES} of the test set")
    return r


def compare(what, lockstep_correct, torch_correct, logits, labels, tolerance, failures):
    diff = lockstep_correct - torch_correct
    print(f"  {what}: lockstep {lockstep_correct / len(labels):.4f} ({lockstep_correct} correct), "
          f"PyTorch {torch_correct / len(labels):.4f} ({torch_correct} correct)")
    if diff == 0:
        return
    top = logits.topk(2, dim=1)
    gap = top.values[:, 0] - top.values[:, 1]
    near = int((gap <= 1e-4 * top.values[:, 0].abs().clamp(min=1.0)).sum())  # far above f32 GEMM rounding
    print(f"  {what}: the counts differ by {diff:+d}; mlp_train gives no answers per image, so here are PyTorch's "
          f"closest calls ({near} images have a top-two gap within 1e-4 relative):")
    for i in gap.argsort()[:abs(diff) + 5].tolist():
        print(f"    image {i}: label {int(labels[i])}, top two classes {int(top.indices[i, 0])} and "
              f"{int(top.indices[i, 1])}, gap {float(gap[i]):.3g}")
    if abs(diff) > tolerance:
        failures.append(f"{what}: {diff:+d} correct answers, tolerance {tolerance}")
    else:
        print(f"  {what}: within --tolerance {tolerance}")


def lockstep_to_torch(a, st, hidden, test, work, failures):
    print(f"lockstep -> PyTorch: mlp_train trains {a.steps} steps and saves a checkpoint")
    save = os.path.join(work, "lockstep-checkpoints")
    r = run_mlp_train(a, ["--epochs", "100", "--max-steps", str(a.steps), "--print-every", "1000000", "--save", save]
                      + shlex.split(a.train_options))
    if "checkpoint" not in r:
        raise Failure("mlp_train --save printed no 'checkpoint' in its JSON")
    ck = os.path.normpath(r["checkpoint"])
    if not re.fullmatch(r"step-\d{12}", os.path.basename(ck)) or \
            os.path.realpath(os.path.dirname(ck)) != os.path.realpath(save):
        failures.append(f"checkpoint {ck} is not {save}/step-<12 digits>")
    path = os.path.join(ck, "model.safetensors")
    tensors = st[0](path)
    # fp32 values, and the batch norms' counts in int64 as PyTorch keeps them
    wrong = {k: str(t.dtype) for k, t in tensors.items()
             if str(t.dtype) != ("torch.int64" if k.endswith("num_batches_tracked") else "torch.float32")}
    if wrong:
        raise Failure(f"{path} holds tensors of unexpected types (F32, and I64 for num_batches_tracked): {wrong}")
    model = build_model(a, hidden)
    model.load_state_dict(tensors, strict=True)  # every name and shape, nothing missing, nothing extra
    print(f"  loaded {path}: {', '.join(f'{k} {list(t.shape)}' for k, t in tensors.items())}")
    for what, digest in (("the file's data section", data_section_sha256(path)),
                         ("the loaded PyTorch tensors", parameters_sha256(model))):
        ok = digest == r["weights_sha256"]
        print(f"  SHA-256 of {what}: {digest} {'==' if ok else '!='} weights_sha256")
        if not ok:
            failures.append(f"SHA-256 of {what} != mlp_train's weights_sha256")
    correct, logits = evaluate(model, test)
    compare("lockstep's checkpoint", r["test_correct"], correct, logits, test[1], a.tolerance, failures)


def torch_to_lockstep(a, st, hidden, train_set, test, work, failures):
    import torch
    print(f"PyTorch -> lockstep: PyTorch trains {a.steps} steps (batch {BATCH}, SGD lr {LR} momentum {MOMENTUM})")
    torch.manual_seed(SEED)
    model = build_model(a, hidden)
    train(model, train_set, a.steps)
    correct, logits = evaluate(model, test)
    if correct < len(test[1]) // 2:
        raise Failure(f"PyTorch's model reached only {correct / len(test[1]):.4f}: too close to chance to compare")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    digest = parameters_sha256(model)
    files = {"plain names": os.path.join(work, "torch.safetensors"),
             "'module.' names": os.path.join(work, "torch-dataparallel.safetensors")}
    st[1](state, files["plain names"])
    st[1]({"module." + k: v for k, v in state.items()}, files["'module.' names"])
    for what, path in files.items():
        r = run_mlp_train(a, ["--load-model", path, "--epochs", "0"])
        if r["weights_sha256"] != digest:
            failures.append(f"PyTorch's file with {what}: weights_sha256 {r['weights_sha256']} != {digest}")
        compare(f"PyTorch's file with {what}", r["test_correct"], correct, logits, test[1], a.tolerance, failures)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample", "--mlp-train", dest="mlp_train", required=True,
                   help="the sample's binary: mlp_train, or cnn_train with --model cnn")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp", help="the sample's model (default mlp)")
    p.add_argument("--hidden", default="128", help="hidden widths, as the sample's --hidden (default 128)")
    p.add_argument("--channels", default="32,64", help="--model cnn: cnn_train's --channels (default 32,64)")
    p.add_argument("--dropout", type=float, default=0.5, help="--model cnn: cnn_train's --dropout (default 0.5)")
    p.add_argument("--steps", type=int, default=200, help="training steps on each side (default 200)")
    p.add_argument("--data", default=cp.DATA, help=f"Fashion-MNIST IDX files (default {cp.DATA})")
    p.add_argument("--tolerance", type=int, default=0, help="correct answers the counts may differ by (default 0)")
    p.add_argument("--devices", default="host:0", help="mlp_train's --devices ('' for its default; default host:0)")
    p.add_argument("--workdir", help="keep the files here (default: a temporary directory, removed at the end)")
    p.add_argument("--train-options", default="",
                   help="more mlp_train options for the run that saves the checkpoint, e.g. '--mode ddp --zero 2' "
                        "(a sharded run saves whole tensors)")
    a = p.parse_args()
    try:
        hidden = [int(h) for h in a.hidden.split(",")]
    except ValueError:
        p.error(f"--hidden {a.hidden}: give widths like 256,256")
    if a.steps < 1 or a.tolerance < 0:
        p.error("--steps must be at least 1 and --tolerance at least 0")
    try:
        import torch
        import numpy  # noqa: F401
    except ImportError as e:
        # Debian's python3-torch belongs to the system interpreter, which may not be the first python3 on PATH.
        if os.path.realpath(sys.executable) != os.path.realpath(cp.TORCH_PYTHON) and \
                "LOCKSTEP_INTEROP_REEXEC" not in os.environ:
            os.environ["LOCKSTEP_INTEROP_REEXEC"] = "1"
            os.execv(cp.TORCH_PYTHON, [cp.TORCH_PYTHON, os.path.abspath(__file__)] + sys.argv[1:])
        print(f"interop: SKIP (PyTorch is not installed: {e})")
        return 77
    missing = [f for f in FILES if not os.path.exists(os.path.join(a.data, f))]
    if missing:
        print(f"interop: SKIP (Fashion-MNIST is not in {a.data}: {', '.join(missing)} missing)")
        return 77
    if not os.access(a.mlp_train, os.X_OK):
        print(f"interop: FAIL ({a.mlp_train} is not an executable; build the sample first)")
        return 1
    torch.set_num_threads(1)
    st = safetensors_io()
    print(f"safetensors: {st[2]}; PyTorch {torch.__version__}")
    if a.workdir:
        os.makedirs(a.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="lockstep-interop-", dir=a.workdir)  # a fresh directory, in --workdir if given
    failures = []
    try:
        check_scaling()
        test = load_split(a.data, "t10k")
        directions = [("lockstep -> PyTorch", lambda: lockstep_to_torch(a, st, hidden, test, work, failures)),
                      ("PyTorch -> lockstep",
                       lambda: torch_to_lockstep(a, st, hidden, load_split(a.data, "train"), test, work, failures))]
        for name, check in directions:
            try:
                check()
            except Exception as e:  # Failure; RuntimeError from load_state_dict (names, shapes); an unreadable file
                print(str(e) if isinstance(e, Failure) else traceback.format_exc().rstrip())
                failures.append(f"{name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
    except Failure as e:
        failures.append(str(e))
    finally:
        if a.workdir:
            print(f"files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("interop: PASS" if not failures else f"interop: FAIL ({'; '.join(failures)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
