#!/bin/bash
# (issue 28, pass 8) The paired A/B runs: this tree (pass 8) and the tree before it (a copy of 8892756 in
# /tmp/before28, run with PYTHONPATH=/tmp/before28), each one benchmarks.live_sync run under its own exclusive
# lock, the pair's order alternated from run to run (odd runs pass 8 first, even runs the tree before first).
# Each tree runs from a copy of its own (python -m puts the working directory first on sys.path): the tree before
# from /tmp/before28, pass 8 from PASS8 (default /tmp/pass8tree: git archive cc2f550), so the repository's
# working tree may change while the window runs.
# Usage, from the repository root: bash docs/ina_live/pass8/window.sh FIRST_RUN LAST_RUN
cd "$(dirname "$0")/../../.."
one() {  # run model tree
    local r=$1 m=$2 t=$3 out dir=${PASS8:-/tmp/pass8tree}
    if [ "$t" = before ]; then out=$PWD/docs/ina_live/pass8/run$r/before_$m; dir=/tmp/before28; else out=$PWD/docs/ina_live/pass8/run$r/$m; fi
    mkdir -p "$out"
    echo "$(date -u +%FT%TZ) start run $r $m $t" >> docs/ina_live/pass8/window.log
    (cd "$dir" && flock -x /tmp/atp-cpu.lock env PYTHONPATH="$dir" python -m benchmarks.live_sync --model "$m" \
        --modes switchml_shm --pool 64,512 --payloads 2048,8192,16000 --steps 4 --repeats 3 --out "$out" \
        > "$out.stdout" 2> "$out.stderr")
    echo "$(date -u +%FT%TZ) end   run $r $m $t rc=$?" >> docs/ina_live/pass8/window.log
}
for r in $(seq "$1" "$2"); do
    for m in small tiny; do
        if [ $((r % 2)) = 1 ]; then one "$r" "$m" pass8; one "$r" "$m" before; else one "$r" "$m" before; one "$r" "$m" pass8; fi
    done
done
