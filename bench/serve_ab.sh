#!/usr/bin/env bash
# One tree served on one GPU over HTTP (4b synthetic checkpoint, BF16, torch backend, prefix cache
# off) under the traffic suite, for comparing two trees on one machine in turns: its start to
# /health 200, the mixed suite and its held-out stream at one client, the 12-question
# 1920x1080 JPEG and 1-question 1920x1080 PNG requests, the suite at 1, 4, 16 and 64 clients
# (GPU busy sampled), then the worker's shape builds by phase, its passes and its GPU memory from
# /metrics; RESTART=1 starts it once more, with the caches the first start left; QUICK=1 leaves
# out the mixed and held-out single-client runs, CLIENTS=1,16 other client counts (none:
# no such run); VIDEO=1 adds a 16-frame clip against a still and stills beside clips;
# CHECKPOINT_ONLY=1 builds the checkpoint and stops; SERVE_ARGS adds to `omnijev serve`'s
# options (`--merge off`), ENGINES_OF=NAME serves NAME's engine directory. TREE is this
# tree (.) or another revision's files (`git archive REV | tar x -C .before`, carried); the load
# driver is always this tree's.
# With `check`, bench.packed_check runs last, in process (shape builds, bytes alone and together).
#   bash bench/serve_ab.sh TREE NAME OUTDIR [check]
set -uo pipefail
tree=${1:?usage: bench/serve_ab.sh TREE NAME OUTDIR}; name=${2:?}; out=${3:?}
root=$PWD; tree=$(cd "$tree" && pwd); mkdir -p "$out"
source "$root/bench/gpu_site.sh"; gpu_site
export FLA_PATH=/tmp/fla PYTHONUNBUFFERED=1
ck=/tmp/omnijev/4b-export; en=/tmp/omnijev/engines-${ENGINES_OF:-$name}; url=http://127.0.0.1:8000
log() { echo "[$(date +%T), ${SECONDS} s] $*" | tee -a "$out/log.txt"; }
if [[ ! -d $ck ]]; then
  log "checkpoint"
  PYTHONPATH=/tmp/site:$root python3 -c "
import shutil; from pathlib import Path
from build_engines.checkpoints import make_checkpoint, release_path
make_checkpoint('4b', 0, Path('$ck')); shutil.rmtree(release_path(Path('$ck')), ignore_errors=True)"
fi
[[ ${CHECKPOINT_ONLY:-0} == 1 ]] && exit 0
(cd "$tree" && PYTHONPATH=/tmp/site:$tree python3 -c "
from build_engines.engines import torch_engine_dir; torch_engine_dir('$ck', '$en', 'bfloat16')")
log "$name: serve"
(cd "$tree" && PYTHONPATH=/tmp/site:/tmp/fla:$tree exec python3 -m runtime.cli serve \
  --checkpoint "$ck" --engines "$en" --port 8000 --prefix-cache 0 --backend torch ${SERVE_ARGS:-} \
  > "$out/$name-server.log" 2>&1) &
server=$!
until curl -sf $url/health > /dev/null; do
  kill -0 $server 2> /dev/null || { log "$name: the server exited"; tail -40 "$out/$name-server.log"; exit 1; }
  grep -q "warm-up failed" "$out/$name-server.log" && { log "$name: warm-up failed"; kill $server; exit 1; }
  sleep 0.5
done
log "$name: ready"
load() {  # NAME-SUFFIX, then bench.load's options
  local label=$1; shift
  PYTHONPATH=/tmp/site:$root python3 -m bench.load --url $url/v1/systemone --suite traffic \
    --seed 0 --out "$out/$name-$label.json" "$@" 2>&1 | tail -4 | tee -a "$out/log.txt"
}
[[ ${QUICK:-0} == 1 ]] || load mixed-c1 --clients 1 --requests 100 --warm-up 8
load q12-jpeg --clients 1 --requests 20 --questions 12 --image-size 1920x1080 --format jpeg
load q1-png --clients 1 --requests 20 --questions 1 --image-size 1920x1080 --format png
[[ ${QUICK:-0} == 1 ]] || load heldout-c1 --clients 1 --requests 60 --held-out
if [[ ${VIDEO:-0} == 1 ]]; then  # issue 48: a 16-frame clip against a still, then mixed load
  load still-720p --clients 1 --requests 20 --questions 12 --image-size 1280x720 --format png
  load clip-16 --clients 1 --requests 20 --questions 12 --image-size 1280x720 --clip-frames 16
  load stills-c16 --clients 16 --requests 200
  load mixed-c16 --clients 16 --requests 200 --clip-frames 16 --clip-share 0.25
fi
curl -s $url/metrics > "$out/$name-metrics-before.txt"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 250 \
  > "$out/$name-gpu-busy.csv" &
smi=$!
# the same suite requests at 1, 4, 16 and 64 clients in turn: requests/s, p50/p99, and whether
# every request's answers are the same bytes in every run (alone, and batched under load); a 503
# is retried after its Retry-After, as the SDKs do, so that 64 clients count what was served
[[ ${CLIENTS:-} == none ]] ||
  load clients --clients ${CLIENTS:-1,4,16,64} --requests ${CLIENT_REQUESTS:-300} --retries 30
kill $smi
curl -s $url/metrics > "$out/$name-metrics.txt"
grep -E "^omnijev_(shape_build|cuda_memory|packed|pass_|device_busy)" "$out/$name-metrics.txt" | tee -a "$out/log.txt"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tee -a "$out/log.txt"
kill $server; wait $server 2> /dev/null
log "$name: served"
if [[ ${RESTART:-0} == 1 ]]; then  # a second start, with the engine directory's caches now
  (cd "$tree" && PYTHONPATH=/tmp/site:/tmp/fla:$tree exec python3 -m runtime.cli serve \
    --checkpoint "$ck" --engines "$en" --port 8000 --prefix-cache 0 --backend torch ${SERVE_ARGS:-} \
    > "$out/$name-server2.log" 2>&1) &
  server=$!; started=$SECONDS
  until curl -sf $url/health > /dev/null; do
    kill -0 $server 2> /dev/null || { log "$name: the second start exited"; break; }
    sleep 0.5
  done
  log "$name: ready again in $((SECONDS - started)) s (caches)"
  kill $server; wait $server 2> /dev/null
fi
if [[ ${4:-} == check ]]; then
  log "$name: check"
  (cd "$tree" && PYTHONPATH=/tmp/site:/tmp/fla:$tree timeout ${CHECK_S:-120} python3 -m bench.packed_check \
    --checkpoint "$ck" --engines "$en" --requests 9 --out "$out/$name-check.json" \
    > "$out/$name-check.log" 2>&1); tail -25 "$out/$name-check.log"
fi
log "$name: done"
