#!/usr/bin/env bash
# The GPU figures owed (docs/benchmarks.md), in one prepared call on one GPU (an H200 when lent):
#   1. bench/gpu.py --levers float8-nocompile: torchao's float8nocompile prototype, now run eager (its Triton
#      kernels inside compiled blocks failed to compile on 2026-11-28), after its own bf16 baseline;
#   2. bench/finetune.py --shape sd3: gentrain's sd3-lora step against diffusers' train_dreambooth_lora_sd3.py
#      on an SD3-shaped transformer at real width (random weights, bf16), when the peer script is carried;
#   3. bench/latent_shards.py with train.num_workers=4 (the loader with workers; 0.974x without, 2026-11-28);
#   4. tests/test_float8.py and tests/test_gpu_step.py, then float8-cdt with whatever time is left.
# Each step is independent (a failure or a timeout keeps the others' results); every step prints its time.
#
# On the device machine (the packages it lacks travel as wheels in .whl/, installed only where one is missing;
# the peer's scripts and a torchvision wheel matching the machine's torch in .peer/, both ignored by git):
#   run(carry=[".whl", ".peer"], command="set -o pipefail; bash bench/gpu_owed.sh 2>&1 | tee $OUT/log.txt")
# .peer/ holds train_dreambooth_lora_sd3.py from diffusers' examples at the installed diffusers' tag and
# torchvision-0.26.0-cp312-*.whl (torch 2.11's pair: the scripts import torchvision; gentrain does not), which is
# installed into its own folder, on the peer's path only.
# Results go to $OUT (default ./gpu-owed-out): nocompile/levers.json, finetune-sd3.json, latent-shards-4w.json,
# pytest.xml, cdt/levers.json. GENTRAIN_OWED_BUDGET_S (default 460) is the whole script's time; CPU smoke test:
#   GENTRAIN_OWED_QUICK=1 bash bench/gpu_owed.sh   (tiny steps; the float8 levers skip without a GPU)
set -u
OUT=${OUT:-$PWD/gpu-owed-out}
mkdir -p "$OUT/nocompile" "$OUT/cdt"
export PYTHONUNBUFFERED=1
BUDGET=${GENTRAIN_OWED_BUDGET_S:-460}
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

stamp "levers float8-nocompile (eager)"
timeout -k 5 "${GENTRAIN_OWED_NOCOMPILE_S:-110}" python3 bench/gpu.py --levers float8-nocompile "${Q[@]}" \
  --out "$OUT/nocompile"
echo "levers float8-nocompile rc=$?"

PEER_SCRIPT=.peer/train_dreambooth_lora_sd3.py
if [ -f "$PEER_SCRIPT" ]; then
  PEER_SITE=/tmp/peer-site
  ls .peer/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target "$PEER_SITE" .peer/*.whl
  printf '#!/bin/sh\nPYTHONPATH=%s:${PYTHONPATH:-} exec python3 "$@"\n' "$PEER_SITE" > /tmp/peer-python
  chmod +x /tmp/peer-python
  /tmp/peer-python -c "import torchvision; print('peer torchvision', torchvision.__version__)" || echo "peer torchvision does not import"
  if [ "$QUICK" = 1 ]; then
    FT_ARGS=(--steps 4 --warmup 1 --rounds 1 --resolution 64 --blocks 1 --no-checkpoints)
  else
    FT_ARGS=(--steps 30 --warmup 5 --rounds 2 --resolution 512 --blocks 4 --batch 4 --threads 8)
  fi
  stamp "finetune sd3 ${FT_ARGS[*]}"
  FT_DEV=$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
  timeout -k 5 "${GENTRAIN_OWED_FINETUNE_S:-200}" python3 bench/finetune.py --shape sd3 --device "$FT_DEV" --dtype bf16 \
    --peer-script "$PEER_SCRIPT" --peer-python /tmp/peer-python "${FT_ARGS[@]}" --json "$OUT/finetune-sd3.json"
  echo "finetune sd3 rc=$?"
else
  stamp "finetune skipped: no $PEER_SCRIPT (carry .peer)"
fi

stamp "latent_shards ${LS_ARGS[*]} workers=4"
timeout -k 5 "${GENTRAIN_OWED_LS_S:-120}" python3 bench/latent_shards.py "${LS_ARGS[@]}" --set train.num_workers=4 \
  --json "$OUT/latent-shards-4w.json"
echo "latent_shards rc=$?"

if [ "$(left)" -ge 60 ]; then
  stamp "pytest tests/test_float8.py tests/test_gpu_step.py"
  timeout -k 5 55 python3 -m pytest -q -p no:cacheprovider tests/test_float8.py tests/test_gpu_step.py \
    --junitxml="$OUT/pytest.xml"
  echo "pytest rc=$?"
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
