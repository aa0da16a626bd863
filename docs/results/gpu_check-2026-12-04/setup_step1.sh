#!/usr/bin/env bash
# call 1: install the carried wheels, park half A of the SmolLM2 GGUF outside the repo, quick import check
set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
mkdir -p /root/smol && cp .gpu/a/smol.part0 /root/smol/smol.part0 && ls -la /root/smol
nvidia-smi -L
python3 -c "
import inspect, torch, transformers, huggingface_hub, accelerate, gguf, omegaconf, hydra, draftsmith, draftsmith.eval.decoder, draftsmith.methods, draftsmith.data_gen.target, draftsmith.eval.cost, draftsmith.machine, draftsmith.sampling, draftsmith.heads.eagle3, draftsmith.eval.proposers.draft
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
print('imports ok: torch', torch.__version__, 'transformers', transformers.__version__, transformers.__file__, 'hub', huggingface_hub.__version__, 'accelerate', accelerate.__version__, 'cuda', torch.cuda.is_available(), draftsmith.__file__)
print('LlamaDecoderLayer.forward params:', list(inspect.signature(LlamaDecoderLayer.forward).parameters))
"
echo step1 done
