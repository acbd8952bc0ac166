#!/usr/bin/env python3
"""Compile time of lockstep for its users (issue: the first hour): the CPU seconds and peak memory of compiling,
cold (no ccache), a user's training file (bench/compile_time/training_file.cpp: a graph with a custom layer, DDP,
f16 with a loss scaler, AdamW, a data loader, a checkpointer), a file that only includes lockstep.hpp, and the
samples, each with the exact command CMake gives the sample (Release: -O3), read from a build directory's
compile_commands.json.

  python3 bench/compile_time.py [--build build/compile-time] [--repeats 3] [--json out.json]

Configures the build directory (CMAKE_EXPORT_COMPILE_COMMANDS, Release) if it has no compile_commands.json; builds
nothing else. Each file is compiled --repeats times, alternated; the table gives medians. Run it on a quiet machine.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_command(build):
    path = os.path.join(build, "compile_commands.json")
    if not os.path.exists(path):
        subprocess.run(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", "-DLOCKSTEP_CUDA=OFF"], check=True,
                       stdout=subprocess.DEVNULL)
    sample = os.path.join(ROOT, "examples", "mlp_train", "main.cpp")
    for entry in json.load(open(path)):
        if os.path.realpath(entry["file"]) == os.path.realpath(sample):
            words = entry.get("arguments") or shlex.split(entry["command"])
            return [w for w in words if not w.endswith("ccache")], entry["directory"]
    sys.exit("compile_time: %s has no command for examples/mlp_train/main.cpp" % path)


def measure(words, directory, source):
    """CPU seconds (user + system) and peak resident memory (MiB) of compiling `source` with the sample's command."""
    out = tempfile.mktemp(suffix=".o")
    args = []
    skip = False
    for w in words:
        if skip:
            skip = False
            continue
        if w in ("-o", "-MF", "-MT", "-c"):
            skip = True
            continue
        if w in ("-MD", "-MMD") or w.endswith(".cpp"):
            continue
        args.append(w)
    cmd = ["/usr/bin/time", "-f", "%U %S %M"] + args + ["-c", source, "-o", out]
    r = subprocess.run(cmd, cwd=directory, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit("compile_time: compiling %s failed:\n%s" % (source, r.stderr[-4000:]))
    user, system, kib = r.stderr.strip().splitlines()[-1].split()
    os.unlink(out)
    return float(user) + float(system), int(kib) / 1024.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "compile-time"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    words, directory = compile_command(a.build)
    include_only = os.path.join(tempfile.mkdtemp(), "include_only.cpp")
    with open(include_only, "w") as f:
        f.write("#include <lockstep/lockstep.hpp>\nint main() { return 0; }\n")
    files = [("training file (graph, custom layer, DDP, f16, AdamW, loader, checkpointer)",
              os.path.join(ROOT, "bench", "compile_time", "training_file.cpp")),
             ("only #include <lockstep/lockstep.hpp>", include_only),
             ("examples/mlp_train/main.cpp", os.path.join(ROOT, "examples", "mlp_train", "main.cpp"))]
    cnn = os.path.join(ROOT, "examples", "cnn_train", "main.cpp")
    if os.path.exists(cnn):
        files.append(("examples/cnn_train/main.cpp", cnn))
    runs = {name: [] for name, _ in files}
    for _ in range(a.repeats):
        for name, path in files:
            runs[name].append(measure(words, directory, path))
    print("compile, cold, the sample's Release command (%s); medians of %d" % (os.path.basename(words[0]), a.repeats))
    print("| file | CPU s | peak MiB |")
    print("| --- | ---: | ---: |")
    result = {}
    for name, _ in files:
        cpu = statistics.median(r[0] for r in runs[name])
        mib = statistics.median(r[1] for r in runs[name])
        result[name] = {"cpu_seconds": cpu, "peak_mib": mib, "runs": runs[name]}
        print("| %s | %.1f | %.0f |" % (name, cpu, mib))
    if a.json:
        json.dump(result, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
