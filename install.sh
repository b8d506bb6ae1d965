#!/usr/bin/env bash
# Installs kda-moe (editable) with a PyTorch build that fits the machine, then the extras asked for.
#   bash install.sh          # the package
#   bash install.sh dev      # + test / reference dependencies (pytest, fla, peft, datasets, ...)
# A machine without a CUDA GPU gets PyTorch's CPU build: pinned to 2.13.0, which pip takes from the local wheel
# cache where one is configured; elsewhere set PIP_INDEX_URL / TORCH_INDEX_URL to PyTorch's CPU wheel index.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
if ! "$python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$python" -m pip install "torch>=2.5"
  else
    "$python" -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
  fi
fi
extra=${1:-}
"$python" -m pip install -e ".${extra:+[$extra]}"
