#!/usr/bin/env bash
# The device check, in order of value, inside one 8-minute device call (set-up included):
#   0. set-up: the wheels of benchmarks/device_wheels.sh installed offline if carried
#      (.whl/), and jaxfill imported from this checkout without installing it;
#   a. the attention oracle tests on the GPU (xla, pallas_gpu, reference) -> $OUT/oracle.xml,
#      and mosaic_gpu's compiled oracle cases -> $OUT/oracle_mosaic_gpu.xml
#   b. kernel time vs cuDNN at 4k/16k/32k prefill and a mixed batch (gpu_attention.py)
#   c. Llama-3-8B-shaped bf16 prefill through Engine.generate at 2k/8k/32k (TTFT, tok/s,
#      MFU) and decode tok/s at batch 64 (gpu_engine.py)
# Each part has its own time limit; a failing part is reported and the next one runs.
#
#   bash benchmarks/gpu_kernels.sh              # on the device: results under $OUT
#   bash benchmarks/gpu_kernels.sh --dry-run    # any machine: tiny shapes (CI runs this)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=""; [[ "${1:-}" == "--dry-run" ]] && DRY="--dry-run"
export OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"

# 0. set-up
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -3
fi
if ! "$PY" -c "import jaxfill" 2>/dev/null; then  # import this checkout as `jaxfill`
  link="$(mktemp -d)"; ln -s "$PWD" "$link/jaxfill"; export PYTHONPATH="$link${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import sys, jax, jaxfill; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())" \
  | tee "$OUT/versions.txt"
status=0

# a. the oracle tests on this backend (dry run: a few cases of the xla impl)
sel="xla or pallas_gpu or reference"; [[ -n "$DRY" ]] && sel="xla and corner_cases and decode_only"
timeout "${ORACLE_S:-110}" "$PY" -m pytest -q -p no:cacheprovider tests/test_attention_oracle.py \
  -k "$sel" --junitxml="$OUT/oracle.xml" -x -q 2>&1 | tail -15 || status=1
# a2. mosaic_gpu compiled on the GPU (never run before; Hopper only, skips elsewhere and
#     in the dry run) against the same oracle
timeout "${MOSAIC_S:-90}" "$PY" -m pytest -q -p no:cacheprovider tests/test_attention_mosaic_gpu.py \
  -k compiled -rs --junitxml="$OUT/oracle_mosaic_gpu.xml" -q 2>&1 | tail -15 || status=1

# b. kernels vs cuDNN
BUDGET_S="${ATTENTION_S:-110}" timeout $(( ${ATTENTION_S:-110} + 20 )) "$PY" benchmarks/gpu_attention.py $DRY || status=1

# c. the engine
BUDGET_S="${ENGINE_S:-150}" timeout $(( ${ENGINE_S:-150} + 60 )) "$PY" benchmarks/gpu_engine.py $DRY || status=1
ls -l "$OUT"
exit $status
