# (issue 28, pass 7) second 16-core window, the tree before first; the same carried trees as ../device.sh
set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
R=$PWD; W=/tmp/w2; mkdir -p $W
{ date -u; nproc; python3 -V; } 2>&1 | tee $W/env.txt
run() { local m=$1 t=$2 d=$R; [ $t != final ] && d=$R/outputs/p7trees/$t
  mkdir -p $W/$m; local t0=$SECONDS
  echo "$m $t start $(date -u +%T)" | tee -a $W/window.log
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 100 python3 -m benchmarks.live_sync --model $m --modes switchml_shm --pool 64,512 --payloads 2048,8192,16000 --steps 4 --repeats 3 --out $W/$m/$t > $W/$m/$t.log 2>&1)
  echo "$m $t rc=$? in $((SECONDS-t0)) s" | tee -a $W/window.log; grep -E "ring:|switchml" $W/$m/$t.log | tee -a $W/window.log; }
run tiny before; run tiny final; run small before; run small final
tar -czf $OUT/run2.tgz -C $W .
