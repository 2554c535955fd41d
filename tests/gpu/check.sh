#!/usr/bin/env bash
# The GPU check of issue 24, for a lent accelerator (the `device` tool; not part of CI): installs the
# stack if the machine has no .venv yet, then runs tests/gpu/check.py on CUDA (under 5 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1 transformers==5.23.0 -e '.[test]'
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec .venv/bin/python tests/gpu/check.py --device cuda "$@"
