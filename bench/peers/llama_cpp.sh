#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the third serving peer) into bench/.llama-cpp (git-ignored):
# llama-cpp-python's sdist from PyPI carries llama.cpp in vendor/llama.cpp; cmake + ninja,
# target llama-server only, CPU only, ~6 minutes on 2 cores. Prints the server's path.
# Idempotent: does nothing but print when the binary is there.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$here/.llama-cpp"
version="0.3.36"
src="$root/llama_cpp_python-$version/vendor/llama.cpp"
bin="$src/build/bin/llama-server"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$root"
python="${PYTHON:-$here/../.venv/bin/python}"
if [ ! -d "$src" ]; then
    echo "llama.cpp: downloading llama-cpp-python $version's sdist" >&2
    "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root" >&2
    tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$root"
fi
echo "llama.cpp: building llama-server (~6 min)" >&2
cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$src/build" --target llama-server -j "$(nproc)" >&2
echo "$bin"
