# Session 25, first 4-GPU call: the whole GPU suite at R = 4 on today's kernels (issue 38; issue 44's GPU soak
# and the loopback's shared-clock check are in it), then the README's main command on 4 GPUs (issue 40: gRPC lines).
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L | head -4 | cut -c1-40; echo "## build $(( $(date +%s) - t0 )) s"
timeout 480 python -m pytest -q tests/test_gpu.py -rfE --durations=8 > $OUT/test_gpu_r4.log 2>&1; echo "## test_gpu R=4 rc $? at $(( $(date +%s) - t0 )) s"
tail -22 $OUT/test_gpu_r4.log | cut -c1-300
left=$(( 580 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && { (cd /tmp && timeout $left python -m jax_uccl_ep.launch -n 4 $OLDPWD/examples/train_moe.py --steps 20) > $OUT/readme_main.log 2>&1; echo "## readme main rc $? at $(( $(date +%s) - t0 )) s"; echo "## gRPC/Gloo/WatchTasks lines: $(grep -ciE 'grpc|WatchTasks|gloo|Connection refused' $OUT/readme_main.log)"; tail -6 $OUT/readme_main.log | cut -c1-200; }
