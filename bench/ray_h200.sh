#!/usr/bin/env bash
# Issue 38 on one H200: the 4b synthetic checkpoint (BF16, torch backend, bench.gpu's build)
# served three ways on port 8011, each checked to give the single worker's answers (latency
# fields aside) and then loaded with the traffic suite at 16 closed-loop clients (bench.load):
#   single   `omnijev serve`                                   one process
#   ray1     `omnijev serve --replicas 1`                      one GPU replica on Ray Serve
#   ray2     `omnijev serve --replicas 2 --replica-gpus 0.5`   two replicas sharing the GPU
# Records to OUTDIR (answers-*.json, load-*.json, server-*.log, ray.json), output to OUTDIR/log.txt.
# Carry .gpu-wheels/server, .gpu-wheels/torch (bench/wheels.sh) and .gpu-wheels/raysite.tar.xz
# (bench/ray_wheels.sh), about 57 MiB, in the same call:
#   BENCH_COMMIT=<sha> bash bench/ray_h200.sh OUTDIR
set -euo pipefail
out=${1:?usage: bench/ray_h200.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
port=8011
clients=${CLIENTS:-16}
log() { echo "[$(date +%T), ${SECONDS} s] $*" | tee -a "$out/log.txt"; }
source bench/gpu_site.sh; gpu_site
if [[ ! -d /tmp/site/ray ]]; then
  tar xJf .gpu-wheels/raysite.tar.xz -C /tmp/site
fi
export FLA_PATH=/tmp/fla PYTHONPATH=/tmp/site:/tmp/fla:$PWD PATH=/tmp/site/bin:$PATH
export RAY_USAGE_STATS_ENABLED=0
log "bench.gpu build"
python3 -u -m bench.gpu build --out "$out" 2>&1 | tee -a "$out/log.txt"
work=/tmp/omnijev
read -r -a warm < <(python3 -c "
from pathlib import Path
from bench.gpu import Machine, warm_files
print(' '.join(warm_files(Machine('4b', 'cuda', 'bfloat16', Path('$work'), Path('$out')))))")

answers() {  # the answers of every bench workload and 16 traffic requests, latency fields aside
  python3 - "$1" <<'PY'
import json, sys, urllib.request
from bench import traffic
from bench.parity import without_latency
from bench.workloads import bench_bodies
bodies = [*bench_bodies().values(), *(traffic.request(0, i, "suite").body for i in range(16))]
found = []
for body in bodies:
    post = urllib.request.Request("http://127.0.0.1:8011/v1/systemone", body,
                                  {"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=300) as answer:
        found.append(without_latency(json.loads(answer.read())))
open(sys.argv[1], "w").write(json.dumps(found))
PY
}

run() {  # NAME, then `omnijev serve` options beyond the common ones
  local name=$1
  shift
  log "$name: omnijev serve $*"
  python3 -u -m runtime.cli serve --checkpoint "$work/4b-export" \
    --engines "$work/engines-4b-bfloat16" --backend torch --device cuda --port "$port" \
    "${warm[@]}" "$@" >"$out/server-$name.log" 2>&1 &
  local server=$! started=$SECONDS
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    if ! kill -0 "$server" 2>/dev/null || ((SECONDS - started > 900)); then
      log "$name: not ready"; tail -40 "$out/server-$name.log"; kill "$server" || true; return 1
    fi
    sleep 1
  done
  log "$name: ready in $((SECONDS - started)) s"
  answers "$out/answers-$name.json"
  python3 -u -m bench.load --url "http://127.0.0.1:$port/v1/systemone" --suite traffic \
    --clients "$clients" --requests 160 --warm-up 32 --out "$out/load-$name.json" \
    2>&1 | tee -a "$out/log.txt" || true
  curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics-$name.txt" || true
  kill -TERM "$server"
  wait "$server" || true
}

run single
run ray1 --replicas 1 --replica-gpus 1
run ray2 --replicas 2 --replica-gpus 0.5
python3 - "$out" <<'PY' | tee -a "$out/log.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
names = ("single", "ray1", "ray2")
answers = {n: json.loads((out / f"answers-{n}.json").read_text()) for n in names}
record = {"same_answers": {n: answers[n] == answers["single"] for n in names[1:]}, "runs": {}}
print("| serving | same answers | requests/s | p50 ms | p90 ms |\n| --- | --- | ---: | ---: | ---: |")
for n in names:
    run = json.loads((out / f"load-{n}.json").read_text())["runs"][-1]
    record["runs"][n] = run = {k: v for k, v in run.items() if k != "records"}
    latency = run.get("latency_ms", {})
    same = "-" if n == "single" else record["same_answers"][n]
    print(f"| {n} | {same} | {run['requests_per_s']:.2f} | {latency.get('p50', 0):.0f} "
          f"| {latency.get('p90', 0):.0f} |")
(out / "ray.json").write_text(json.dumps(record, indent=1))
PY
log "done"
