#!/usr/bin/env bash
# CPU A/B of batching across requests: the base tree (80c4890, a worktree at $BASE with its own
# engine directory $BASE_ENGINES, built by that tree) and this tree serve the tiny demo model in
# turns (ONNX Runtime, CPU); bench.load drives each with 1 and 16 closed-loop clients.
#   BASE=../base BASE_ENGINES=/tmp/engines-base bash run.sh OUTDIR   (from the repository root)
set -u
OUT=$1
ROOT=$PWD
PY=$ROOT/.venv/bin/python
CK=$ROOT/artifacts/demo/checkpoint
mkdir -p "$OUT"
port=8210
serve() {  # tree cache
  local dir=$BASE en=$BASE_ENGINES
  if [ "$1" = main ]; then dir=$ROOT; en=$ROOT/artifacts/demo/engines; fi
  (cd $dir && PYTHONPATH=$dir exec $PY -m runtime.cli serve --checkpoint $CK --engines $en --port $port --prefix-cache $2 > "$OUT/serve-$1-c$2.log" 2>&1) &
  pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
}
load() {  # name args...
  local name=$1; shift
  (cd $ROOT && PYTHONPATH=$ROOT $PY -m bench.load --url http://127.0.0.1:$port/v1/systemone \
    --clients 1,16 --requests 32 --warm-up 4 "$@" --out "$OUT/$name.json") > "$OUT/$name.txt" 2>&1
}
for round in 1 2; do
  for tree in base main; do
    for cache in 0 8; do
      serve $tree $cache
      load $tree-c$cache-same4-q1-r$round --images 4 --image-size 800x600 --format png --questions 1
      load $tree-c$cache-same4-q4-r$round --images 4 --image-size 800x600 --format png --questions 4
      if [ $cache = 0 ]; then
        load $tree-c0-distinct-q1-r$round --image-size 800x600 --format png --questions 1
        load $tree-c0-distinct-q4-r$round --image-size 800x600 --format png --questions 4
        load $tree-c0-suite-r$round
      fi
      curl -s http://127.0.0.1:$port/metrics | grep -E "^omnijev_batch_requests|^omnijev_shape_builds" > "$OUT/metrics-$tree-c$cache-r$round.txt"
      kill -TERM $pid; wait $pid 2>/dev/null
      sleep 1
    done
  done
done
echo done > "$OUT/DONE"
