# First call on a multi-GPU kind (x2, x4 or x8): the issue-24 sweep beside NCCL on every lent GPU, then the copy
# probe (push against pull: issue 23's combine question) and the two-GPU tests. ~6-7 min. Then run_x2b.sh, run_x2c.sh.
set -u
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
export NCCL_NVLS_ENABLE=0
nvidia-smi topo -m > $OUT/topo.txt 2>&1
timeout 330 python bench/intranode.py --sms 8,12,16,24,32 --iters 30 --repeats 5 --out $OUT/intranode.json > $OUT/intranode.log 2>&1; echo "## intranode rc $?"
G=$(nvidia-smi -L | wc -l)
timeout 90 python bench/copies.py --gpus $G --sms 8,12,16,24,32 --out $OUT/copies.json > $OUT/copies.log 2>&1; echo "## copies rc $?"; grep "^#  " $OUT/copies.log
timeout 120 python -m pytest -q tests/test_gpu.py -k "loopback_runs or copy_bench" 2>&1 | tail -2
grep -E "^(uccl_ep|jax|NCCL|DeepEP)|NVLink buffer" $OUT/intranode.log | cut -c1-120
