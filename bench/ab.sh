#!/usr/bin/env bash
# The bench workloads on one GPU, in one call, for two code trees: this one and BEFORE (another
# revision's files, e.g. `git archive REV | tar x -C .before`, carried with the wheels). Both
# load and compile at once, then are timed in turns (two rounds of 20 runs a workload), and their
# answers compared byte for byte. A change that must not move latency is checked this way.
#   bash bench/ab.sh BEFORE OUTDIR
set -uo pipefail
py=${PYTHON:-python3}
[[ $py == */* && $py != /* ]] && py=$PWD/$py  # the earlier tree runs from its own folder
before=${1:?usage: bench/ab.sh BEFORE OUTDIR}; out=${2:?usage: bench/ab.sh BEFORE OUTDIR}
mkdir -p "$out"; root=$PWD; before=$(cd "$before" && pwd)
if [[ -d .gpu-wheels && -z ${PYTHON:-} ]]; then  # the GPU machine: carried wheels
  source bench/gpu_site.sh; gpu_site "$py"
fi
export FLA_PATH=/tmp/fla PYTHONUNBUFFERED=1
base=/tmp/site:/tmp/fla
preset=${AB_PRESET:-4b}; dtype=${AB_DTYPE:-bfloat16}  # tiny / float32: a CPU trial
ck=/tmp/omnijev/$preset-export; en=/tmp/omnijev/engines-ab-$preset
if [[ ! -d $ck ]]; then
  PYTHONPATH=$base:$root $py -c "
import shutil, time; from pathlib import Path; t=time.time()
from build_engines.checkpoints import make_checkpoint, release_path
make_checkpoint('$preset', 0, Path('$ck')); shutil.rmtree(release_path(Path('$ck')), ignore_errors=True)
print('checkpoint', round(time.time()-t,1), 's')" 2>&1 | tail -2
fi
PYTHONPATH=$base:$root $py -c "
from build_engines.engines import torch_engine_dir; torch_engine_dir('$ck', '$en', '$dtype')"
# BEFORE reads an engine directory of the format it knows: the torch backend's holds no graph,
# only the manifest and compiler caches, so it is the same directory with that format named
en_before=$en-before; rm -rf "$en_before"; cp -r "$en" "$en_before"
(cd "$before" && PYTHONPATH=$base:$before $py -c "
import json; from pathlib import Path; from runtime.manifest import FORMAT, MANIFEST
path = Path('$en_before') / MANIFEST; manifest = json.loads(path.read_text())
manifest['format'] = FORMAT; path.write_text(json.dumps(manifest))")
flags=/tmp/ab-flags; rm -rf $flags; mkdir -p $flags
(cd $before && PYTHONPATH=$base:$before exec $py $root/bench/ab_driver.py before $ck $en_before $flags > $out/before-log.txt 2>&1) &
pid_before=$!
PYTHONPATH=$base:$root $py bench/ab_driver.py after $ck $en $flags > $out/after-log.txt 2>&1 &
pid_after=$!
wait_for() {  # a flag file, while its tree's process lives
  local pid=$1 flag=$2
  until [[ -e $flag ]]; do
    kill -0 "$pid" 2>/dev/null || { echo "the process for $flag ended first"; return 1; }
    sleep 0.2
  done
}
wait_for $pid_before $flags/before.ready && wait_for $pid_after $flags/after.ready || exit 1
echo "[$SECONDS s] both ready"
for r in 0 1; do
  touch $flags/before.go$r; wait_for $pid_before $flags/before.done$r || exit 1
  touch $flags/after.go$r; wait_for $pid_after $flags/after.done$r || exit 1
done
wait
cp $flags/*.json $out/ 2>/dev/null
$py - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); b = json.loads((out/"before.json").read_text()); a = json.loads((out/"after.json").read_text())
same = (out/"before.answers.json").read_text() == (out/"after.answers.json").read_text()
print("ready s", round(b["ready_s"],1), round(a["ready_s"],1), "backend", b["backend"], a["backend"])
print("| workload | before median ms | after median ms | change |")
for n in b["rounds"][0]:
    mb = statistics.median([x for r in b["rounds"] for x in r[n]]); ma = statistics.median([x for r in a["rounds"] for x in r[n]])
    print(f"| {n} | {mb:.1f} | {ma:.1f} | {100*(ma/mb-1):+.1f} % |")
print("answers identical:", same)
PY
echo "[$SECONDS s] done"
