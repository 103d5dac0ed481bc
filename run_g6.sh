# Session 25, one GPU, last call: the merged tree (split kernels, core library + tests' extension, attributes as
# structs, the expert layout) on the GPU paths the budget allows, then whether the layer's step still compiles twice.
set -u
t0=$(date +%s)
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.tok/shim NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
echo "## build $(( $(date +%s) - t0 )) s"
timeout 250 python -m pytest -q tests/test_proxy_gpu.py -rfE -k "pushes_every_command or (nvlink_path and normal) or (across_nodes and normal-0) or (moe_layer and 0) or loopback_holds" > $OUT/suite.log 2>&1; echo "## GPU-initiated / NVLink tests rc $? at $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|^FAILED|^E  " $OUT/suite.log | head -10 | cut -c1-250
UCCL_EP_GPU_INITIATED=0 timeout 120 python -m pytest -q tests/test_proxy_gpu.py -rfE -k "across_nodes and 0" > $OUT/staged.log 2>&1; echo "## host-staged tests rc $? at $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|^FAILED|^E  " $OUT/staged.log | head -8 | cut -c1-250
left=$(( 495 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && { timeout $left python examples/train_moe.py --lr 0.0003 --lr-warmup-steps 10 --clip-norm 1.0 --ep-impl uccl --time-every 100 --seed 0 --steps 4 --batch-per-device 4 --seq-len 1024 --d-model 2048 --d-ff 1024 --heads 16 --experts 64 --top-k 8 --layers 4 > $OUT/steps.log 2>&1; echo "## steps rc $? at $(( $(date +%s) - t0 )) s"; grep -E "^step" $OUT/steps.log | cut -c1-110; }
