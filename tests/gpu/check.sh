#!/usr/bin/env bash
# The GPU check of issue 24, for a lent accelerator (the `device` tool; not part of CI), under 5 minutes.
# With a .venv (make demo / make test made it) that python runs it. Without one, on a machine whose python3
# already holds a CUDA build of torch and has no network (the device machines), ppmedia and any wheels
# carried in .whl/ (e.g. the pinned transformers) are installed beside it into a scratch folder; else the
# pinned stack is installed into a new .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    site=/tmp/ppmedia-site
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" . \
      $(ls .whl/*.whl 2>/dev/null || true)
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    PY=python3
  else
    python3 -m venv .venv
    .venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1 transformers==5.23.0 -e '.[test]'
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
exec "$PY" tests/gpu/check.py --device cuda "$@"
