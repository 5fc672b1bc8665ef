#!/usr/bin/env bash
# One GPU lease's three calls, back to back on the warm machine (each within a call's 10
# minutes; results tarred into OUTDIR, since a call returns at most 8 files):
#   1: `bench.blas_rows` on cards other than the H100 (this card's products, row count by row
#      count, and the backend's load-time check), then the checkpoint and this tree served under
#      the traffic suite, and started once more with its caches (`bench/serve_ab.sh . new`);
#   2: the baseline tree in .before (`git archive 226ddae | tar x -C .before`, carried) served
#      the same way, then the reference's time on the suite's 12-question requests;
#   3: this tree in process (`bench.packed_check`: every question alone against its request,
#      the stage and kernel profiles), then BF16 parity with the BF16 reference's own distance.
# Carry .gpu-wheels (and .before for call 2):
#   BENCH_COMMIT=<sha> bash bench/lease.sh 1 "$OUT"
set -uo pipefail
call=${1:?usage: bench/lease.sh 1|2|3 OUTDIR}; out=${2:?usage: bench/lease.sh 1|2|3 OUTDIR}
work=/tmp/lease-$call; mkdir -p "$work"
export PYTHONUNBUFFERED=1 FLA_PATH=/tmp/fla
if [[ ! -d /tmp/site/fastapi ]]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/server/*.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/fla .gpu-wheels/torch/*.whl
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/card.txt"
ck=/tmp/omnijev/4b-export
# a serving run cut by its limit leaves its worker behind (it holds the port and the GPU's memory)
stop_workers() { pkill -f "runtime.cli serve" && sleep 2; return 0; }
case $call in
  1)
    # measured on the H100 already (docs/measurements/h100-2026-12-06b): other cards only
    grep -q H100 "$work/card.txt" || PYTHONPATH=/tmp/site:. timeout 100 python3 -m bench.blas_rows \
      --out "$work/blas-rows.json" > "$work/blas-rows.log" 2>&1
    RESTART=1 CLIENT_REQUESTS=300 timeout $((580 - SECONDS)) bash bench/serve_ab.sh . new "$work"
    stop_workers
    ;;
  2)
    CLIENT_REQUESTS=300 timeout 390 bash bench/serve_ab.sh .before base "$work"
    stop_workers
    PYTHONPATH=/tmp/site:/tmp/fla:. timeout 180 python3 -m bench.reference_suite \
      --checkpoint "$ck" --requests 3 --runs 10 --out "$work/reference-suite.json" \
      > "$work/reference.log" 2>&1
    ;;
  3)
    PYTHONPATH=/tmp/site:/tmp/fla:. timeout 240 python3 -m bench.packed_check --checkpoint "$ck" \
      --engines /tmp/omnijev/engines-new --requests 9 --out "$work/check.json" \
      > "$work/check.log" 2>&1
    PYTHONPATH=/tmp/site:/tmp/fla:. timeout 320 python3 -m runtime.cli parity --checkpoint "$ck" \
      --engines /tmp/omnijev/engines-new --backend torch --bf16-reference --device cuda \
      --out "$work/parity.json" > "$work/parity.log" 2>&1
    ;;
  *) echo "the call is 1, 2 or 3, got $call"; exit 2 ;;
esac
tar czf "$out/lease-$call.tgz" -C "$work" .
cp "$work/log.txt" "$out/" 2> /dev/null
tail -30 "$work/log.txt" "$work"/*.log 2> /dev/null
