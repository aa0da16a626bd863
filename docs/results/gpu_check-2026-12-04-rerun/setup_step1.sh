#!/usr/bin/env bash
# call 1 (carry .whl .gpu/a): install the carried wheels into /tmp/site, park half A of the SmolLM2 GGUF outside the repo,
# quick import check
set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /root/smol && cp .gpu/a/smol.part0 /root/smol/smol.part0 && ls -la /root/smol
nvidia-smi -L
python3 -c "
import inspect, torch, transformers, huggingface_hub, accelerate, gguf, omegaconf, hydra, draftsmith, draftsmith.eval.decoder, draftsmith.eval.proposers.kit
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
print('imports ok: torch', torch.__version__, 'transformers', transformers.__version__, transformers.__file__, 'hub', huggingface_hub.__version__, 'accelerate', accelerate.__version__, 'cuda', torch.cuda.is_available(), draftsmith.__file__)
print('LlamaDecoderLayer.forward params:', list(inspect.signature(LlamaDecoderLayer.forward).parameters))
" 2>&1 | tee $OUT/setup_step1.log
echo step1 done
