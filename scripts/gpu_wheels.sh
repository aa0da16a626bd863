#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has torch, transformers 5.17, safetensors, peft, numpy, pyarrow, but no
# deepspeed, hydra-core, omegaconf, datasets, pydantic, speculators, and a transformers older than draftsmith's
# 5.25), plus draftsmith itself, into .whl/ for the device tool to carry (64 MiB a call; these are ~26 MB).
# Run here, in the checkout, with network access to PyPI:
#
#   bash scripts/gpu_wheels.sh            # -> .whl/*.whl (Python 3.12, manylinux x86-64: the lent machines')
#
# and on the GPU machine, before scripts/gpu_check.sh:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl transformers==5.25.0 hydra-core==1.3.2 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 \
    multiprocess==0.70.19 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    speculators==0.9.0 loguru pydantic-settings python-dotenv gguf==0.19.0 huggingface-hub==2.4.0 kernels==0.19.1 \
    hf-xet==1.8.0 regex==2026.12.2 httpx2==2.17.0 httpcore2==2.17.0 click==8.5.1 tomlkit==0.15.3 \
    truststore==0.10.5 idna==3.21 anyio==4.16.0
# deepspeed and antlr4 (hydra's parser) publish source only: build pure-Python wheels here (no ops compiled)
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
rm -f .whl/draftsmith-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
du -sh .whl
