#!/usr/bin/env bash
# call 1 (carry .whl .gpu/a .gpu/call1.sh): install the carried wheels into /tmp/site, park half A of the SmolLM2 GGUF
# outside the repo (/root/smol), quick import check. As docs/results/gpu_check-2026-12-04-rerun/setup_step1.sh, plus
# datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19 (absent from the device image; data-gen/train/eval import datasets).
set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee $OUT/call1.log || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /root/smol && cp .gpu/a/smol.part0 /root/smol/smol.part0 && ls -la /root/smol | tee -a $OUT/call1.log
{ nvidia-smi -L; nproc; free -g | head -2
  python3 -c "
import sys, torch, transformers, huggingface_hub, accelerate, datasets, gguf, omegaconf, hydra, draftsmith, draftsmith.train.run, draftsmith.eval.run, draftsmith.data_gen.run
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__, transformers.__file__, 'hub', huggingface_hub.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__, datasets.__file__, 'draftsmith', draftsmith.__file__)
"; } 2>&1 | tee -a $OUT/call1.log
echo call1 done | tee -a $OUT/call1.log
