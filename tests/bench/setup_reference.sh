#!/usr/bin/env bash
# Install NeMo Automodel 0.7.0 (no dependencies) into tests/bench/.ref for the side-by-side benchmark.
# Only tests/bench/run.py reads it, and only the single module
# nemo_automodel/components/datasets/vlm/pp_media.py (which imports nothing but torch).
# The project's virtual environment is never touched: pip writes into the --target folder only.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
target="$here/.ref"
module="$target/nemo_automodel/components/datasets/vlm/pp_media.py"
if [[ -f "$module" ]]; then
    echo "reference already installed: $module"
    exit 0
fi
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" "nemo-automodel==0.7.0"
test -f "$module" || { echo "nemo-automodel 0.7.0 installed but $module is missing" >&2; exit 1; }
echo "reference installed: $module"
