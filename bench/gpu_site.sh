# The GPU machine's missing packages from the carried .gpu-wheels (bench/wheels.sh): the server
# stack and the image codecs into /tmp/site, fla-core into /tmp/fla, PyAV into /tmp/site where
# carried. A machine lent again may keep an earlier lease's /tmp, so a folder of wheels is
# installed again whenever it differs from the one installed there (a stamp of its names): a
# wheel added since is never missed.
#   source bench/gpu_site.sh; gpu_site [PYTHON]
gpu_site() {
  local py=${1:-python3} pair kind target stamp
  for pair in server:/tmp/site torch:/tmp/fla video:/tmp/site; do
    kind=${pair%%:*}; target=${pair#*:}; stamp=$target/.wheels-$kind
    [[ -d .gpu-wheels/$kind ]] || continue
    if [[ "$(ls .gpu-wheels/$kind)" != "$(cat "$stamp" 2> /dev/null)" ]]; then
      "$py" -m pip install -q --no-index --no-deps --upgrade --target "$target" .gpu-wheels/"$kind"/*.whl
      ls .gpu-wheels/"$kind" > "$stamp"
    fi
  done
}
