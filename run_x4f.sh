# Session 25, second 4-GPU call (same warm machine): the GPU suite at R = 2, then the two-level bench row
# (4 processes as 2 nodes x 2 GPUs: NVLink within a node, the proxy over tcp between them), issue 38.
set -u
t0=$(date +%s)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
(cd /tmp && python -c "import jax_uccl_ep._uccl_ep") 2>/dev/null || { bash bench/device_run.sh none > $OUT/build.txt 2>&1 || exit 1; echo "## rebuilt"; }
CUDA_VISIBLE_DEVICES=0,1 timeout 400 python -m pytest -q tests/test_gpu.py -rfE > $OUT/test_gpu_r2.log 2>&1; echo "## test_gpu R=2 rc $? at $(( $(date +%s) - t0 )) s"
tail -8 $OUT/test_gpu_r2.log | cut -c1-300
left=$(( 585 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && { UCCL_EP_GPUS_PER_NODE=2 timeout $left python bench/normal.py --gpus --ranks 4 --tokens 4096 --hidden 7168 --topk 8 --experts 256 --ops dispatch,dispatch_fp8,combine --out $OUT/two_level.json > $OUT/two_level.log 2>&1; echo "## two-level rc $?"; tail -12 $OUT/two_level.log | cut -c1-220; }
