# One GPU: the grouped matmul's tests and microbench, the layer's training step at R = 1 (issue 39).
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "## build $(( $(date +%s) - t0 )) s"
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > $OUT/tok_install.txt 2>&1 || tail -5 $OUT/tok_install.txt
export PYTHONPATH=/tmp/site:$PWD/.tok/shim NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python -c "import tokamax, jax; print('# tokamax', tokamax.__version__, 'jax', jax.__version__, jax.devices()[0].device_kind)" 2>&1 | tail -2
timeout 200 python -m pytest -q -x tests/test_grouped_gpu.py -rA -s > $OUT/grouped_tests.log 2>&1; echo "## tests rc $?"; grep -E "passed|failed|Error|error|\{'" $OUT/grouped_tests.log | cut -c1-400 | tail -8
timeout 120 python bench/grouped_matmul.py --out $OUT/grouped.json > $OUT/grouped.log 2>&1; echo "## grouped bench rc $?"; tail -8 $OUT/grouped.log
timeout 400 python bench/train_step.py --impls uccl,all_to_all,dense --steps 10 --warmup 4 --out $OUT/train1.json > $OUT/train1.log 2>&1; echo "## train rc $?"; tail -6 $OUT/train1.log | cut -c1-250
