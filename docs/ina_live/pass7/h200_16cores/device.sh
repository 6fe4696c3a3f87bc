# (issue 28, pass 7) run on the 16-core H200 host from the repository root with .whl/ (the lead's wheels) and outputs/p7trees/{before,inline} (git archive of a48e55f and d885493: atp_pipeline benchmarks conf) carried; "final" = the working tree at f89400c's live code
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
R=$PWD
{ date -u; nproc; python3 -V; git -C $R log --oneline -1 2>/dev/null; } 2>&1 | tee $OUT/env.txt
run() { # model tree
  local m=$1 t=$2 d=$R; [ $t != final ] && d=$R/outputs/p7trees/$t
  mkdir -p $OUT/$m; local t0=$SECONDS
  echo "$m $t start $(date -u +%T)" | tee -a $OUT/window.log
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 100 python3 -m benchmarks.live_sync --model $m --modes switchml_shm --pool 64,512 --payloads 2048,8192,16000 --steps 4 --repeats 3 --out $OUT/$m/$t > $OUT/$m/$t.log 2>&1)
  echo "$m $t rc=$? in $((SECONDS-t0)) s" | tee -a $OUT/window.log; grep -E "ring:|switchml" $OUT/$m/$t.log | tee -a $OUT/window.log
}
run tiny final; run tiny before; run tiny inline; run small final; run small before
