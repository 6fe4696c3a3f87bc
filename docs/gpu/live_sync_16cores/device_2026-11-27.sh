set -o pipefail
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ date -u; nvidia-smi -L; nproc; python3 -c "import torch,transformers,pytorch_lightning,lightning,hydra;print(torch.__version__,transformers.__version__,pytorch_lightning.__version__,hydra.__version__)"; } 2>&1 | tee $OUT/env.txt
t0=$SECONDS
timeout 260 python3 -m pytest tests/test_cuda.py -p no:cacheprovider -v -rs --durations=5 2>&1 | tee $OUT/test_cuda.log
echo "test_cuda rc=$? in $((SECONDS-t0)) s" | tee -a $OUT/test_cuda.log
for m in tiny small; do
  t0=$SECONDS
  timeout 110 python3 -m benchmarks.live_sync --model $m --modes switchml_shm --pool 64,512 --payloads 2048,8192,16000 --steps 4 --repeats 3 --out $OUT/ls_$m > $OUT/ls_$m.log 2>&1
  echo "live_sync $m rc=$? in $((SECONDS-t0)) s" | tee -a $OUT/ls_$m.log; tail -25 $OUT/ls_$m.log
done
ls -R $OUT
