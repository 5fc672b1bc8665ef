#!/usr/bin/env bash
# One GPU lease's calls, back to back on the warm machine, each step taking what is left of a
# call's ten minutes (results tarred into OUTDIR, since a call returns at most 8 files):
#   1: the checkpoint, then this tree served cold under the traffic suite (`bench/serve_ab.sh`:
#      latency at one client, clips against stills with PyAV carried in .gpu-wheels/video);
#   2: the baseline in .before (`git archive 226ddae | tar x -C .before`, carried) served cold
#      the same way, without clips or 64 clients; this tree in process (`bench.packed_check`:
#      every question alone against its request, the stage and kernel profiles); `omnijev
#      bench`'s six workloads in this tree then the baseline (BASE_CLIENTS=1: the baseline at
#      one client only; WORKLOADS=0: no workloads, for a lease short of time);
#   3: BF16 parity beside the BF16 reference's own distance to float32 (the four stills and
#      MORE_IMAGES seeded ones, 12 by default: 320 answers), the reference's time on
#      the suite's 12-question requests, `bench.blas_rows` on cards other than the H100, the
#      start on the caches under cProfile (`bench.start_profile`), the baseline's kernel profile.
#   4: (a short lease's second call) call 2's in-process check, then call 3's parity and reference.
#   5: this tree served again on the caches call 1 left (its start), the suite at 1, 16 and 64
#      clients with every answer compared, then at one client with `--merge off` (ALONE=0: not).
#   6: (a lease short of time's last) the reference's time and the start under cProfile.
#   7: (a lease with one call's time) the checkpoint, this tree and the baseline served at one
#      client, this tree's stage and kernel profiles.
#   8: (the least) the checkpoint, this tree's engine directory, its profiles in process.
#   9: the packed recurrence alone against .prev/packed_kernels.py (bench.delta_step).
# A full lease is calls 1, 5, 2, 3; a short one 1 and 4; one call 7 or 8. Carry .gpu-wheels and .before:
#   CALL_S=580 bash bench/lease.sh 1 "$OUT"
set -uo pipefail
call=${1:?usage: bench/lease.sh 1-9 OUTDIR}; out=${2:?usage: bench/lease.sh 1-9 OUTDIR}
# a machine lent again may keep an earlier lease's /tmp: none of its results may pass for this one's
work=/tmp/lease-$call; rm -rf "$work"; mkdir -p "$work"
export PYTHONUNBUFFERED=1 FLA_PATH=/tmp/fla
source bench/gpu_site.sh; gpu_site  # PyAV too, for clips
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$work/card.txt"
ck=/tmp/omnijev/4b-export
# a serving run cut by its limit leaves its worker behind (it holds the port and the GPU's memory)
stop_workers() { pkill -f "runtime.cli serve" && sleep 2; return 0; }
left() { local s=$((${CALL_S:-585} - SECONDS)); echo $((s > 1 ? s : 1)); }  # what is left of the call (CALL_S, at most ten minutes), less the tar
py() { PYTHONPATH=/tmp/site:/tmp/fla:. timeout "$@"; }  # SECONDS, then the module and its options
# the results so far into OUTDIR each minute: a call cut short (its limit, or the lease's time
# spent) still returns what it had
(while sleep 60; do tar czf "$out/.lease-$call.tgz" -C "$work" . && mv "$out/.lease-$call.tgz" "$out/lease-$call.tgz"; done) &
saver=$!
exit_call() {  # the call's results into OUTDIR, and the ends of its logs
  kill $saver 2> /dev/null
  tar czf "$out/lease-$call.tgz" -C "$work" .
  cp "$work/log.txt" "$out/" 2> /dev/null
  tail -30 "$work/log.txt" "$work"/*.log 2> /dev/null
  exit 0
}
# the steps several calls run, each given its timeout in seconds
check() {  # this tree in process: every question alone against its request, stage and kernel profiles
  py "$1" python3 -m bench.packed_check --checkpoint "$ck" --engines /tmp/omnijev/engines-new \
    --requests 6 --out "$work/check.json" > "$work/check.log" 2>&1
}
parity() {  # BF16 parity beside the BF16 reference's own distance to float32
  py "$1" python3 -m runtime.cli parity --checkpoint "$ck" \
    --engines /tmp/omnijev/engines-new --backend torch --bf16-reference --device cuda \
    --more-images "${MORE_IMAGES:-12}" --out "$work/parity.json" > "$work/parity.log" 2>&1
}
reference() {  # the reference's time on the suite's 12-question requests
  py "$1" python3 -m bench.reference_suite --checkpoint "$ck" --requests 3 --runs 10 \
    --out "$work/reference-suite.json" > "$work/reference.log" 2>&1
}
start_profile() {  # where a start on call 1's caches spends its time
  py "$1" python3 -m bench.start_profile --checkpoint "$ck" --engines /tmp/omnijev/engines-new \
    --out "$work/start-profile.json" > "$work/start-profile.log" 2>&1
}
case $call in
  1)
    CHECKPOINT_ONLY=1 bash bench/serve_ab.sh . new "$work"
    VIDEO=1 CLIENTS=none timeout $(($(left) - 30)) bash bench/serve_ab.sh . new "$work"
    stop_workers
    ;;
  2)
    CLIENTS=${BASE_CLIENTS:-1,16} CLIENT_REQUESTS=200 timeout $(($(left) - 200)) bash bench/serve_ab.sh .before base "$work"
    stop_workers
    check $(($(left) / 3))
    # the bench's six workloads in process, this tree then the baseline (issue 46: ≤ 10 % slower)
    [[ ${WORKLOADS:-1} == 0 ]] && exit_call
    py $(($(left) / 2)) python3 -m runtime.cli bench --checkpoint "$ck" --engines /tmp/omnijev/engines-new \
      --backend torch --prefix-cache 0 --clients 0 --out "$work/bench-new.json" > "$work/bench-new.log" 2>&1
    (cd .before && py $(left) python3 -m runtime.cli bench --checkpoint "$ck" \
      --engines /tmp/omnijev/engines-base --backend torch --prefix-cache 0 \
      --out "$work/bench-base.json" > "$work/bench-base.log" 2>&1)
    ;;
  3)
    parity $(($(left) * 3 / 5))
    reference $(($(left) * 2 / 3))
    grep -q H100 "$work/card.txt" || py 100 python3 -m bench.blas_rows --out "$work/blas-rows.json" \
      > "$work/blas-rows.log" 2>&1
    start_profile 150
    py $(left) python3 -m bench.kernels --checkpoint "$ck" --engines /tmp/omnijev/engines-base \
      --tree .before --out "$work/kernels-base.json" > "$work/kernels-base.log" 2>&1
    ;;
  4)
    # a short lease's second call: call 2's in-process check and call 3's parity and reference
    check $(($(left) / 3))
    parity $(($(left) * 2 / 3))
    reference $(left)
    ;;
  5)
    # issue 47's client counts on the engine directory call 1 built (its start is the cached one)
    ENGINES_OF=new QUICK=1 CLIENTS=1,16,64 CLIENT_REQUESTS=${CLIENT_REQUESTS:-200} \
      timeout $(($(left) - 150)) bash bench/serve_ab.sh . cached "$work"
    stop_workers
    [[ ${ALONE:-1} == 0 ]] && exit_call
    # one client with every request alone, against the run above's one client
    ENGINES_OF=new SERVE_ARGS="--merge off" QUICK=1 CLIENTS=1 CLIENT_REQUESTS=200 timeout $(left) \
      bash bench/serve_ab.sh . alone "$work"
    stop_workers
    ;;
  6)
    # a lease short of time's last call: the reference's time (issue 46's 7×) and the start
    # under cProfile, without call 3's parity
    reference $(($(left) * 2 / 3))
    start_profile $(left)
    ;;
  7)
    # a lease with one call's time: the checkpoint, this tree then the baseline served at one
    # client (the mixed suite, the held-out stream, 12 and 1 questions), then this tree's stage
    # and kernel profiles in process
    CHECKPOINT_ONLY=1 bash bench/serve_ab.sh . new "$work"
    CLIENTS=none timeout $(($(left) * 11 / 20)) bash bench/serve_ab.sh . new "$work"
    stop_workers
    CLIENTS=none timeout $(($(left) * 3 / 5)) bash bench/serve_ab.sh .before base "$work"
    stop_workers
    check $(left)
    ;;
  8)
    # the least a lease can settle: the checkpoint, this tree's engine directory, then its
    # stage and kernel profiles and its questions alone against together, in process
    CHECKPOINT_ONLY=1 bash bench/serve_ab.sh . new "$work"
    PYTHONPATH=/tmp/site:. timeout $(($(left) * 2 / 3)) python3 -c "
from build_engines.engines import torch_engine_dir; torch_engine_dir('$ck', '/tmp/omnijev/engines-new', 'bfloat16')" \
      > "$work/engines.log" 2>&1
    check $(left)
    ;;
  9)
    # the packed recurrence alone against a previous version's (`git show REV:runtime/model/
    # packed_kernels.py > .prev/packed_kernels.py`, carried): no checkpoint, a minute
    py $(left) python3 -m bench.delta_step --other .prev/packed_kernels.py \
      --out "$work/delta-step.json" > "$work/delta-step.log" 2>&1
    ;;
  *) echo "the call is 1 to 9, got $call"; exit 2 ;;
esac
exit_call

