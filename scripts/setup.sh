#!/usr/bin/env bash
# Installs what lockstep needs from Debian's packages, if missing. Idempotent: checks first, installs second.
#
#   scripts/setup.sh            build, test and sample dependencies
#   scripts/setup.sh --torch    also PyTorch (python3-torch), the peer of bench/compare_pytorch.py
#   scripts/setup.sh --plots    also matplotlib (python3-matplotlib), for bench/plot.py's figures in docs/
set -euo pipefail

packages=(
  cmake ninja-build g++ clang libclang-rt-14-dev ccache pkg-config
  libgtest-dev libbenchmark-dev
  libopenblas-dev libdnnl-dev zlib1g-dev libxxhash-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist
)
for arg in "$@"; do
  case "$arg" in
    --torch) packages+=(python3-torch) ;;
    --plots) packages+=(python3-matplotlib) ;;
    *) echo "setup.sh: unknown option '$arg' (known: --torch, --plots)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "setup.sh: all ${#packages[@]} packages present"
else
  echo "setup.sh: installing ${missing[*]}"
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup.sh: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
    "${sudo[@]}" apt-get update
    "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  fi
fi

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup.sh: CUDA toolkit found: $(/usr/local/cuda/bin/nvcc --version | tail -n 1)"
else
  echo "setup.sh: no CUDA toolkit in /usr/local/cuda: building the host backend only"
fi
