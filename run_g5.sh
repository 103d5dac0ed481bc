# Session 25, one GPU, second call: the layer on pairs (uccl) beside the layer on token rows (uccl_rows) and
# MaxText-style all_to_all, at R = 1 (issues 39, 42), fine-grained preset.
set -u
t0=$(date +%s)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
(cd /tmp && python -c "import jax_uccl_ep._uccl_ep") 2>/dev/null || { bash bench/device_run.sh none > $OUT/build.txt 2>&1 || exit 1; echo "## rebuilt"; }
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.tok/shim
timeout 400 python bench/train_step.py --impls uccl,uccl_rows,all_to_all --steps 12 --warmup 4 --timeout 180 --out $OUT/train1.json > $OUT/train1.log 2>&1; echo "## train rc $? at $(( $(date +%s) - t0 )) s"
tail -8 $OUT/train1.log | cut -c1-250
# Why the layer compiles twice (steps 1 and 2): uccl's own command, 3 steps, with JAX's cache-miss explanations.
cmd=$(python -c "import json;d=json.load(open('$OUT/train1.json'));print([r for r in d['results'] if r['impl']=='uccl'][0]['command'])")
left=$(( 585 - ($(date +%s) - t0) ))
[ $left -gt 40 ] && { JAX_EXPLAIN_CACHE_MISSES=1 timeout $left $cmd --steps 3 > $OUT/explain.log 2>&1; echo "## explain rc $?"; grep -iE "step +[0-9]+/" $OUT/explain.log | head -3 | cut -c1-120; grep -iE -A7 "cache miss" $OUT/explain.log | grep -v "^\s*$" | head -45 | cut -c1-220; }
