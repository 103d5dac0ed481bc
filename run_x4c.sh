# Second call on the same warm 4-GPU machine: the whole GPU suite at R = 4 (two-level cases included).
set -u
export PYTHONPATH=/tmp/site:$PWD/.tok/shim NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
(cd /tmp && python -c "import jax_uccl_ep._uccl_ep") 2>/dev/null || { bash bench/device_run.sh none > $OUT/build.txt 2>&1 || exit 1; }
timeout 560 python -m pytest -q tests/test_gpu.py tests/test_grouped_gpu.py -rfE > $OUT/test_gpu.log 2>&1; echo "## test_gpu rc $?"; tail -15 $OUT/test_gpu.log | cut -c1-300
