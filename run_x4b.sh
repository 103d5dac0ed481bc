# Issue 39's proof on 4 GPUs (fine-grained step: uccl, MaxText-style all_to_all, dense, ragged; then V3 routing),
# then issue 38's R = 4 cases that failed or never ran (the loopback over NVLink, two-level routing). One call.
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.tok/shim NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L | head -4 | cut -c1-40; echo "## build $(( $(date +%s) - t0 )) s"
timeout 260 python bench/train_step.py --impls uccl,all_to_all,dense,ragged --steps 16 --warmup 6 --timeout 110 --out $OUT/train_fine.json > $OUT/train_fine.log 2>&1; echo "## fine rc $? at $(( $(date +%s) - t0 )) s"
timeout 150 python bench/train_step.py --preset v3 --impls uccl,all_to_all,dense --steps 10 --warmup 4 --timeout 90 --out $OUT/train_v3.json > $OUT/train_v3.log 2>&1; echo "## v3 rc $? at $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
[ $left -gt 40 ] && { timeout $left python -m pytest -q tests/test_gpu.py -k "loopback_runs or two_level" -rfE -s > $OUT/test_gpu.log 2>&1; echo "## test_gpu rc $?"; grep -E "passed|failed|timers disagree|^FAILED" $OUT/test_gpu.log | tail -6 | cut -c1-200; }
for f in fine v3; do tail -7 $OUT/train_$f.log | cut -c1-230; python -c "
import json;d=json.load(open('$OUT/train_$f.json'))
for r in d['results']: print(r['impl'], [round(x,3) for x in r.get('losses',[])][::3], r.get('error','')[:150])"; done
