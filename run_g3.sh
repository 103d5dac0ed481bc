# One GPU: the grouped matmul's tests (JAX's weight-gradient kernel, tuned tokamax tiles), its bench, the step at R = 1.
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.tok/shim NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
echo "## build $(( $(date +%s) - t0 )) s"
timeout 200 python -m pytest -q -x tests/test_grouped_gpu.py -rA -s > $OUT/grouped_tests.log 2>&1; echo "## tests rc $?"; grep -E "passed|failed|^E  |\{'" $OUT/grouped_tests.log | cut -c1-600 | tail -8
timeout 90 python bench/grouped_matmul.py --out $OUT/grouped.json > $OUT/grouped.log 2>&1; echo "## grouped bench rc $?"; tail -7 $OUT/grouped.log
timeout 240 python bench/train_step.py --impls uccl,all_to_all,dense --steps 12 --warmup 4 --out $OUT/train1.json > $OUT/train1.log 2>&1; echo "## train rc $? at $(( $(date +%s) - t0 )) s"; tail -5 $OUT/train1.log | cut -c1-250
python -c "
import json;d=json.load(open('$OUT/train1.json'))
for r in d['results']: print(r['impl'], [round(x,3) for x in r.get('losses',[])])"
