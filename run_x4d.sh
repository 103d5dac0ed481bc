# Last 4-GPU call (device time nearly spent): the fine-grained step, uccl beside MaxText-style all_to_all, no parts.
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.tok/shim NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
echo "## build $(( $(date +%s) - t0 )) s"
timeout 200 python bench/train_step.py --impls all_to_all,uccl --steps 12 --warmup 4 --no-parts --timeout 150 --verbose --out $OUT/train_fine.json > $OUT/train_fine.log 2>&1; echo "## fine rc $? at $(( $(date +%s) - t0 )) s"
grep -E "^step|^# |^uccl|^all_to_all" $OUT/train_fine.log | cut -c1-200 | tail -40
