# Second call: the whole tests/test_gpu.py on every lent GPU (R = 2: 321 s in session 20).
set -u
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
export NCCL_NVLS_ENABLE=0
timeout 540 python -m pytest -q tests/test_gpu.py -rfE > $OUT/test_gpu.log 2>&1; echo "## test_gpu rc $?"; tail -4 $OUT/test_gpu.log
