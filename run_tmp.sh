set -u
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
timeout 240 python -m pytest -q tests/test_proxy_gpu.py -k "copy_bench or normal_mode_kernels" -rA > $OUT/tests.log 2>&1; echo "tests rc $?"; grep -E "PASSED|FAILED|passed|failed" $OUT/tests.log | tail -4
timeout 60 python bench/copies.py --gpus 1 --sms 12 --directions local,pull --copies bulk --out /tmp/c.json 2>&1 | grep "^#  "
