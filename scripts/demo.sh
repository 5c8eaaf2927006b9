#!/usr/bin/env bash
# Fresh virtualenv, install gentrain (CPU torch), train the default preset (digits-ddpm).
# Extra arguments go to `gentrain train`, e.g. scripts/demo.sh train.max_steps=500
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
python3 -m venv "$VENV"
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
"$VENV/bin/pip" install -q torch==2.13.0
# The image's pins (constraints-runtime.txt); constraints.txt is the test environment's.
"$VENV/bin/pip" install -q -c constraints-runtime.txt -e .
exec "$VENV/bin/gentrain" train "$@"
