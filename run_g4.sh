# Session 25, one GPU: the whole one-GPU suite on the split kernels with the expert layout (issues 41, 42, 44).
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.tok/shim NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L | head -2 | cut -c1-40; echo "## build $(( $(date +%s) - t0 )) s"
timeout 540 python -m pytest -q tests/test_proxy_gpu.py tests/test_grouped_gpu.py -rfE --durations=6 > $OUT/suite1.log 2>&1; echo "## one-GPU suite rc $? at $(( $(date +%s) - t0 )) s"
tail -16 $OUT/suite1.log | cut -c1-250
