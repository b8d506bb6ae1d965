#!/usr/bin/env bash
# Installs kda-moe (editable) with a PyTorch build that fits the machine, then the extras asked for.
#   bash install.sh            # the package and what the demo needs (torch, transformers, accelerate, peft, ...)
#   bash install.sh examples   # + datasets and evaluate for examples/finetune.py
#   bash install.sh dev        # + the examples' and the test suite's dependencies (pytest, fla, matplotlib, ...)
# PyTorch is installed only where none can be imported:
#   - TORCH_INDEX_URL set: from that index;
#   - a CUDA GPU that nvidia-smi sees: the CUDA build from PyPI;
#   - otherwise the CPU build of torch 2.13.0: a local wheel where pip has one (e.g. through PIP_FIND_LINKS), else
#     from PyTorch's CPU wheel index, https://download.pytorch.org/whl/cpu (PyPI's Linux wheel is the CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
pip=("$python" -m pip)
cpu_torch="torch==2.13.0"
cpu_index="https://download.pytorch.org/whl/cpu"

if ! "$python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch>=2.5"
  elif [[ -n ${TORCH_INDEX_URL:-} ]]; then
    "${pip[@]}" install --index-url "$TORCH_INDEX_URL" "$cpu_torch"
  elif "${pip[@]}" install --quiet --no-index --no-deps "$cpu_torch" >/dev/null 2>&1; then
    echo "install.sh: $cpu_torch from a local wheel; its dependencies from the package index"
    "${pip[@]}" install "$cpu_torch"
  else
    "${pip[@]}" install --index-url "$cpu_index" "$cpu_torch"
  fi
fi
extra=${1:-}
"${pip[@]}" install -e ".${extra:+[$extra]}"
