#!/usr/bin/env bash
# Create .venv/ at the repo root with poptorch installed in editable mode and
# the extras named in $1 (default "test,demo").
#
# torch: a python3 that already has torch >= 2.13 (for example a CUDA build on
# a GPU machine) is reused through --system-site-packages; otherwise the CPU
# wheel torch==2.13.0 is installed, so a CPU-only machine never pulls CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test,demo}"
if python3 - <<'PY' 2>/dev/null
import torch
major, minor = (int(v) for v in torch.__version__.split(".")[:2])
raise SystemExit(0 if (major, minor) >= (2, 13) else 1)
PY
then
  [ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
else
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q torch==2.13.0 numpy
fi
.venv/bin/python -m pip install -q -e ".[${extras}]"
