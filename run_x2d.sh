# Session 25, 2-GPU call: the whole GPU suite at R = 2 on today's kernels (issue 38; issue 44's GPU soak in it).
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L | head -4 | cut -c1-40; echo "## build $(( $(date +%s) - t0 )) s"
timeout 530 python -m pytest -q tests/test_gpu.py -rfE --durations=10 > $OUT/test_gpu_r2.log 2>&1; echo "## test_gpu R=2 rc $? at $(( $(date +%s) - t0 )) s"
tail -22 $OUT/test_gpu_r2.log | cut -c1-250
