#!/usr/bin/env bash
# Build llama.cpp's llama-server from the tree vendored in the PyPI sdist llama-cpp-python (pinned below), the
# engine CPU users serve GGUF drafters in. No prebuilt binary exists to download. Cached by version outside the
# checkout, in $DRAFTSMITH_CACHE/llamacpp/<version>-<commit> (default ~/.cache/draftsmith): a second run only
# checks the binary. The converter (convert_hf_to_gguf.py) and its gguf-py come from the same tree.
# Prints the folder on its last line.
set -euo pipefail
VERSION=0.3.36
COMMIT=0c1e570
PYTHON=${PYTHON:-python3}
CACHE=${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}
HOME_DIR=$CACHE/llamacpp/$VERSION-$COMMIT
SRC=$HOME_DIR/src
BIN=$HOME_DIR/build/bin/llama-server
for tool in cmake ninja gcc g++; do
    command -v "$tool" >/dev/null || { echo "building llama.cpp needs $tool on PATH, and it is missing: install it (Debian: apt install cmake ninja-build g++)" >&2; exit 1; }
done
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1 && [ -f "$SRC/convert_hf_to_gguf.py" ]; then
    echo "llama.cpp $VERSION-$COMMIT ready (cached)"; echo "$HOME_DIR"; exit 0
fi
mkdir -p "$HOME_DIR"
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
    TMP=$(mktemp -d "$HOME_DIR/.download.XXXXXX")
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
    tar -xzf "$TMP"/llama_cpp_python-$VERSION.tar.gz -C "$TMP"
    rm -rf "$SRC"
    mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"   # rename: a killed download leaves no half tree
    rm -rf "$TMP"
fi
# GGML_NATIVE=OFF: a portable AVX2 binary, so a cache shared between CPU kinds stays valid. (Native is no way out on
# an AMX Xeon: it dies in ggml_backend_amx_mul_mat on the Q4_1 target, llama.cpp #20824, and without AMX it decodes
# no faster: docs/results/issue47-llamacpp-side-by-side-2026-12-06.md.) The prebuilt web UI
# would be fetched from the Hub at build time and openssl is not needed on loopback: both off.
cmake -S "$SRC" -B "$HOME_DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF >/dev/null
cmake --build "$HOME_DIR/build" --target llama-server -j "$(nproc)"
"$BIN" --version
echo "llama.cpp $VERSION-$COMMIT built"
echo "$HOME_DIR"
