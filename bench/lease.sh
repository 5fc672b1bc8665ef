#!/usr/bin/env bash
# One GPU lease's calls, back to back on the warm machine, each step taking what is left of a
# call's ten minutes (results tarred into OUTDIR, since a call returns at most 8 files):
#   1: the checkpoint, then this tree and the baseline in .before (`git archive 226ddae | tar x
#      -C .before`, carried) in turns, each served cold under the traffic suite
#      (`bench/serve_ab.sh`: latency at one client, 1 and 16 clients with every answer compared;
#      VIDEO=1 adds call 4's clips to this tree's turn, for a lease too short for call 4);
#   2: the reference's time on the suite's 12-question requests, BF16 parity beside the BF16
#      reference's own distance to float32, then this tree in process (`bench.packed_check`:
#      every question alone against its request, the stage and kernel profiles), and the
#      baseline's kernel profile of the same three requests (`bench.kernels --tree .before`,
#      on call 1's engine directory: carry .before); with REFERENCE=0, neither the reference's
#      time nor the baseline's kernels but call 5 after the rest;
#   3: `bench.blas_rows` on cards other than the H100, then this tree started with the caches
#      its first start left, under 4 and 64 clients, and again with `--merge off` at one client.
#   4: this tree with clips (PyAV carried in .gpu-wheels/video): a 16-frame 1280x720 clip of 12
#      questions against a still, and stills under 16 clients with and without a quarter clips.
#   5: `omnijev bench`'s six workloads in process, this tree then the baseline (after call 1 on
#      the same warm machine, which built both engine directories; carry .before).
# Carry .gpu-wheels (and .before for calls 1, 2 and 5):
#   BENCH_COMMIT=<sha> bash bench/lease.sh 1 "$OUT"
set -uo pipefail
call=${1:?usage: bench/lease.sh 1-5 OUTDIR}; out=${2:?usage: bench/lease.sh 1-5 OUTDIR}
work=/tmp/lease-$call; mkdir -p "$work"
export PYTHONUNBUFFERED=1 FLA_PATH=/tmp/fla
if [[ ! -d /tmp/site/fastapi ]]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/server/*.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/fla .gpu-wheels/torch/*.whl
fi
if [[ -d .gpu-wheels/video && ! -d /tmp/site/av ]]; then  # PyAV, for clips (call 4)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/video/*.whl
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/card.txt"
ck=/tmp/omnijev/4b-export
# a serving run cut by its limit leaves its worker behind (it holds the port and the GPU's memory)
stop_workers() { pkill -f "runtime.cli serve" && sleep 2; return 0; }
left() { echo $((${CALL_S:-585} - SECONDS)); }  # what is left of the call (CALL_S, at most ten minutes), less the tar
case $call in
  1)
    CHECKPOINT_ONLY=1 bash bench/serve_ab.sh . new "$work"
    # VIDEO=1 adds call 4's clip runs to this tree's turn (PyAV carried; the baseline has no clips)
    VIDEO=${VIDEO:-0} CLIENTS=1,16 CLIENT_REQUESTS=200 timeout $(($(left) * 11 / 20)) \
      bash bench/serve_ab.sh . new "$work"
    stop_workers
    VIDEO=0 CLIENTS=1,16 CLIENT_REQUESTS=200 timeout $(left) bash bench/serve_ab.sh .before base "$work"
    stop_workers
    ;;
  2)
    # REFERENCE=0 leaves out the reference's timing (a lease too short for calls 2 and 5)
    [[ ${REFERENCE:-1} == 1 ]] && PYTHONPATH=/tmp/site:/tmp/fla:. timeout $(($(left) / 3)) \
      python3 -m bench.reference_suite --checkpoint "$ck" --requests 3 --runs 10 \
      --out "$work/reference-suite.json" > "$work/reference.log" 2>&1
    PYTHONPATH=/tmp/site:/tmp/fla:. timeout $(($(left) / 2)) python3 -m runtime.cli parity --checkpoint "$ck" \
      --engines /tmp/omnijev/engines-new --backend torch --bf16-reference --device cuda \
      --out "$work/parity.json" > "$work/parity.log" 2>&1
    PYTHONPATH=/tmp/site:/tmp/fla:. timeout $(($(left) * 2 / 3)) python3 -m bench.packed_check \
      --checkpoint "$ck" --engines /tmp/omnijev/engines-new --requests 6 --out "$work/check.json" \
      > "$work/check.log" 2>&1
    [[ -d .before && ${REFERENCE:-1} == 1 ]] && PYTHONPATH=/tmp/site:/tmp/fla:. timeout $(left) \
      python3 -m bench.kernels --checkpoint "$ck" --engines /tmp/omnijev/engines-base \
      --tree .before --out "$work/kernels-base.json" > "$work/kernels-base.log" 2>&1
    # ...and in its place call 5's six workloads, this tree then the baseline
    [[ ${REFERENCE:-1} == 0 ]] && CALL_S=$(left) bash bench/lease.sh 5 "$work"
    ;;
  3)
    grep -q H100 "$work/card.txt" || PYTHONPATH=/tmp/site:. timeout 100 python3 -m bench.blas_rows \
      --out "$work/blas-rows.json" > "$work/blas-rows.log" 2>&1
    QUICK=1 CLIENTS=4,64 CLIENT_REQUESTS=250 timeout $(($(left) * 2 / 3)) bash bench/serve_ab.sh \
      . new "$work"
    stop_workers
    # one client with every request alone, against call 1's one client (issue 47)
    ENGINES_OF=new SERVE_ARGS="--merge off" QUICK=1 CLIENTS=1 CLIENT_REQUESTS=200 timeout $(left) \
      bash bench/serve_ab.sh . alone "$work"
    stop_workers
    ;;
  4)
    ENGINES_OF=new VIDEO=1 QUICK=1 CLIENTS=none timeout $(left) bash bench/serve_ab.sh . video "$work"
    stop_workers
    ;;
  5)
    # the bench's six workloads in process, this tree then the baseline (issue 46: ≤ 10 % slower)
    PYTHONPATH=/tmp/site:/tmp/fla:. timeout $(($(left) / 2)) python3 -m runtime.cli bench \
      --checkpoint "$ck" --engines /tmp/omnijev/engines-new --backend torch --prefix-cache 0 \
      --clients 0 --out "$work/bench-new.json" > "$work/bench-new.log" 2>&1
    (cd .before && PYTHONPATH=/tmp/site:/tmp/fla:. timeout $(left) python3 -m runtime.cli bench \
      --checkpoint "$ck" --engines /tmp/omnijev/engines-base --backend torch --prefix-cache 0 \
      --out "$work/bench-base.json" > "$work/bench-base.log" 2>&1)
    ;;
  *) echo "the call is 1 to 5, got $call"; exit 2 ;;
esac
tar czf "$out/lease-$call.tgz" -C "$work" .
cp "$work/log.txt" "$out/" 2> /dev/null
tail -30 "$work/log.txt" "$work"/*.log 2> /dev/null
