# Issue 38, first call on a 4-GPU kind: EP4 and EP2 sweeps beside NCCL and XLA, push against pull, low-latency EP4.
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "## build $(( $(date +%s) - t0 )) s"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi topo -m > $OUT/topo.txt 2>&1; nvidia-smi -L | head -4
timeout 230 python bench/intranode.py --sms 8,12,16,24 --iters 30 --repeats 5 --out $OUT/ep4.json > $OUT/ep4.log 2>&1; echo "## ep4 rc $? at $(( $(date +%s) - t0 )) s"
CUDA_VISIBLE_DEVICES=0,1 timeout 170 python bench/intranode.py --sms 8,12,16,24 --iters 30 --repeats 5 --out $OUT/ep2.json > $OUT/ep2.log 2>&1; echo "## ep2 rc $? at $(( $(date +%s) - t0 )) s"
timeout 60 python bench/copies.py --gpus 4 --sms 8,12,24 --out $OUT/copies.json > $OUT/copies.log 2>&1; echo "## copies rc $?"; grep "^#  " $OUT/copies.log
timeout 70 python bench/low_latency.py --out $OUT/ll4.json > $OUT/ll4.log 2>&1; echo "## ll4 rc $? at $(( $(date +%s) - t0 )) s"
for f in ep4 ep2; do echo "## $f"; grep -E "^(uccl_ep|jax|NCCL)|NVLink buffer" $OUT/$f.log | cut -c1-112; done
grep -E "dispatch|combine" $OUT/ll4.log | tail -8 | cut -c1-140
