#!/usr/bin/env bash
# Packs the wheels the GPU machine lacks into as few carries as possible: onnxruntime-gpu's
# package tree compressed with xz (204 MB instead of 255 MB of wheel), the small wheels beside,
# split into 54 MiB chunks under .gpu-pack/1, 2, ... (each carry may hold 64 MiB with the tree).
#   scripts/gpu_bundle.sh WHEEL_DIR     # a folder of downloaded wheels
# Then one `run` per chunk, carrying .gpu-pack/N:  mkdir -p /tmp/pk && cp .gpu-pack/N/part.* /tmp/pk/
# and after the last:  bash scripts/gpu_bundle.sh --install
set -euo pipefail
if [[ "${1:-}" == "--install" ]]; then
  cd /tmp/pk
  cat part.* | tar x && rm part.*
  mkdir -p /tmp/site /tmp/fla
  xz -d -T0 < ort.tar.xz | tar x -C /tmp/site && rm ort.tar.xz
  python3 -m pip install -q --no-index --no-deps --target /tmp/site smallw/*.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/fla smallw/fla/*.whl
  PYTHONPATH=/tmp/site python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"
  exit 0
fi
wheels=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/ort" "$work/smallw/fla"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
  "$(ls "$wheels"/onnxruntime_gpu-*.whl)" "$work/ort"
(cd "$work/ort" && tar cf - . | xz -T0 -6 > "$work/ort.tar.xz")
for w in "$wheels"/*.whl; do
  case "$(basename "$w")" in
    onnxruntime_gpu-*) ;;
    fla_core-*) cp "$w" "$work/smallw/fla/" ;;
    *) cp "$w" "$work/smallw/" ;;
  esac
done
(cd "$work" && tar cf bundle.tar ort.tar.xz smallw)
rm -rf "$root/.gpu-pack" && mkdir -p "$root/.gpu-pack"
(cd "$root/.gpu-pack" && split -b 54m -d "$work/bundle.tar" part.)
n=0
for part in "$root"/.gpu-pack/part.*; do
  n=$((n + 1)); mkdir "$root/.gpu-pack/$n"; mv "$part" "$root/.gpu-pack/$n/"
done
echo "$n chunks in .gpu-pack/"
