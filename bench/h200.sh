#!/usr/bin/env bash
# The 4b synthetic checkpoint on one H200 (over 10 minutes on a fresh machine: split it by steps
# where a call is limited):
# the wheels of .gpu-wheels (bench/wheels.sh) installed, the checkpoint and the torch engine
# directory with its compiler caches built where missing, the bench workloads in process
# (20 warm runs each), then `omnijev serve` (prefix cache off) under the traffic suite at 1, 8
# and 16 closed-loop clients mixed, at 1 and 16 with 12 and 1 questions a request, and the
# first requests of unseen image sizes. Every record goes to OUTDIR as JSON, the output to
# OUTDIR/log.txt.
#   BENCH_COMMIT=<sha> bash bench/h200.sh OUTDIR
set -euo pipefail
out=${1:?usage: bench/h200.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
source bench/gpu_site.sh; gpu_site
export FLA_PATH=/tmp/fla PYTHONPATH=/tmp/site:/tmp/fla:$PWD
step() {
  echo "[$(date +%T), ${SECONDS} s] bench.gpu $*" | tee -a "$out/log.txt"
  python3 -u -m bench.gpu "$@" --out "$out" 2>&1 | tee -a "$out/log.txt"
}
step build
step latency --runs 20
step serve --suite traffic --clients 1,8,16 --requests 160 --warm-up 32
# the issue's two request sizes, 12 and 1 questions, at 1 and 16 clients
step serve --suite traffic --clients 1,16 --requests 64 --questions 12 --warm-up 16
step serve --suite traffic --clients 1,16 --requests 64 --questions 1 --warm-up 16
# the first request of 10 image sizes the warm-up never saw, against each warm
step sizes --questions 12
echo "[$(date +%T), ${SECONDS} s] done" | tee -a "$out/log.txt"
