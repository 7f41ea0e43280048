#!/usr/bin/env bash
# Builds llama.cpp's llama-server (the third serving peer) into bench/.llama-cpp (git-ignored):
# llama-cpp-python's sdist from PyPI carries llama.cpp in vendor/llama.cpp; cmake + ninja,
# target llama-server only, CPU only, ~6 minutes on 2 cores. Prints the server's path.
# Idempotent: does nothing but print when the binary is there.
# --source-only: download and unpack only (no build), and print the source folder: its
# convert_hf_to_gguf.py and gguf-py are what the tests convert checkpoints with.
set -euo pipefail
source_only=0
if [ "${1:-}" = "--source-only" ]; then source_only=1; fi
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$here/.llama-cpp"
version="0.3.36"
src="$root/llama_cpp_python-$version/vendor/llama.cpp"
bin="$src/build/bin/llama-server"
if [ -x "$bin" ] && [ "$source_only" = 0 ]; then echo "$bin"; exit 0; fi
mkdir -p "$root"
python="${PYTHON:-$here/../.venv/bin/python}"
if [ ! -d "$src" ]; then
    echo "llama.cpp: downloading llama-cpp-python $version's sdist" >&2
    "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root" >&2
    staging="$root/unpack.$$"  # unpacked aside, then moved: a cut-short unpack is never taken for the source
    rm -rf "$staging" && mkdir -p "$staging"
    tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$staging"
    mv "$staging/llama_cpp_python-$version" "$root/" && rm -rf "$staging"
fi
if [ "$source_only" = 1 ]; then echo "$src"; exit 0; fi
# On a CPU with AMX this llama.cpp's AMX matmul (built by -march=native) crashes llama-server at its first
# batch (SIGSEGV in ggml_backend_amx_mul_mat, seen on a Xeon with amx_int8, 2026-12-05): there it is built for
# the same CPU's AVX-512 (F, BW, VBMI, VNNI, BF16) and AVX-VNNI instead, its fastest kernels that run
arch=(-DGGML_NATIVE=ON)
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    arch=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
          -DGGML_AVX_VNNI=ON)
    echo "llama.cpp: AMX here; building for AVX-512 without AMX" >&2
fi
echo "llama.cpp: building llama-server (~6 min)" >&2
cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${arch[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$src/build" --target llama-server -j "$(nproc)" >&2
echo "$bin"
