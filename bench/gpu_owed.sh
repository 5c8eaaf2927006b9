#!/usr/bin/env bash
# The GPU figures owed since 2026-11-28 (docs/benchmarks.md), in one prepared call on one GPU (an H200 here):
#   1. bench/latent_shards.py: encoded shards against the same run held in memory, on a GPU;
#   2. bench/gpu.py --levers float8-nocompile, then --levers float8-cdt (each its own process, after its own bf16
#      baseline, with its own timeout: inductor's coordinate-descent tuning ran past a call's time before);
#   3. tests/test_gpu_step.py, while time is left.
# Each step is independent (a failure or a timeout keeps the others' results); every step prints its time.
#
# On the device machine (the packages it lacks travel as wheels in .whl/, installed only where one is missing):
#   set -o pipefail; bash bench/gpu_owed.sh 2>&1 | tee $OUT/log.txt
# Results go to $OUT (default ./gpu-owed-out): latent-shards.json, nocompile/levers.json, cdt/levers.json,
# pytest.xml. GENTRAIN_OWED_BUDGET_S (default 450) is the whole script's time; CPU smoke test:
#   GENTRAIN_OWED_QUICK=1 bash bench/gpu_owed.sh   (tiny steps; the float8 levers skip without a GPU)
set -u
OUT=${OUT:-$PWD/gpu-owed-out}
mkdir -p "$OUT/nocompile" "$OUT/cdt"
export PYTHONUNBUFFERED=1
BUDGET=${GENTRAIN_OWED_BUDGET_S:-450}
QUICK=${GENTRAIN_OWED_QUICK:-0}
START=$SECONDS
stamp() { echo "=== $* (t=$((SECONDS - START)) s)"; }
left() { echo $((BUDGET - (SECONDS - START))); }

stamp setup
git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -30
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
NEEDED="diffusers pydantic blake3 webdataset braceexpand vector_quantize_pytorch einx loguru torchao"
if ! python3 -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) is None for n in sys.argv[1:]))" $NEEDED \
  && ls .whl/*.whl >/dev/null 2>&1; then
  # without --no-compile: the first import would otherwise byte-compile diffusers and torchao (~12 s)
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
python3 - <<'EOF' || echo "version probe failed"
import torch, diffusers, torchao, pydantic
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "torchao", torchao.__version__, "diffusers",
      diffusers.__version__, "pydantic", pydantic.__version__, "device", torch.cuda.get_device_name() if cuda else "cpu",
      "capability", torch.cuda.get_device_capability() if cuda else None)
EOF

if [ "$QUICK" = 1 ]; then
  LS_ARGS=(--steps 12 --warmup 2 --rounds 1)
  Q=(--quick)
else
  LS_ARGS=(--steps 200 --warmup 20 --rounds 3)
  Q=()
fi

stamp "latent_shards ${LS_ARGS[*]}"
timeout -k 5 "${GENTRAIN_OWED_LS_S:-190}" python3 bench/latent_shards.py "${LS_ARGS[@]}" --json "$OUT/latent-shards.json"
echo "latent_shards rc=$?"

stamp "levers float8-nocompile"
timeout -k 5 "${GENTRAIN_OWED_NOCOMPILE_S:-130}" python3 bench/gpu.py --levers float8-nocompile "${Q[@]}" \
  --out "$OUT/nocompile"
echo "levers float8-nocompile rc=$?"

# The tests only when the coordinate-descent lever keeps at least 120 s after them.
if [ "$(left)" -ge $((120 + 75)) ]; then
  stamp "pytest tests/test_gpu_step.py"
  timeout -k 5 75 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_step.py --junitxml="$OUT/pytest.xml"
  echo "pytest rc=$?"
else
  stamp "pytest skipped: $(left) s left, kept for float8-cdt"
fi

T=$(( $(left) - 5 ))
if [ "$T" -ge 30 ]; then
  stamp "levers float8-cdt (timeout $T s)"
  timeout -k 5 "$T" python3 bench/gpu.py --levers float8-cdt "${Q[@]}" --out "$OUT/cdt"
  echo "levers float8-cdt rc=$? (124: ran past its $T s)"
else
  stamp "levers float8-cdt skipped: $(left) s left"
fi
stamp done
