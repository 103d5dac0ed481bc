# Third call: where the link binds: the loopback's sides over the GPUs, the send/receive split, ring lags, SM stores.
set -u
bash bench/device_run.sh none > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
export NCCL_NVLS_ENABLE=0
G=$(nvidia-smi -L | wc -l)
lb() { tag=$1; shift; timeout 90 python bench/loopback.py --copies bulk --iters 10 --gpus $G --ranks $G --out /tmp/lb.json "$@" > /tmp/l.txt 2>&1; echo "## lb $tag rc $?"; grep "^#" /tmp/l.txt | grep -v "^# 20" | sed 's/combine:scan.*combine:combine_send/combine_send/;s/dispatch://g' | cut -c1-200; cat /tmp/l.txt >> $OUT/loopback.log; }
b() { tag=$1; shift; timeout 60 python bench/intranode.py --no-torch --ops dispatch,dispatch_fp8,combine --iters 30 --repeats 7 --out /tmp/x.json "$@" > /tmp/l.txt 2>&1; echo "## $tag rc $?"; grep "^uccl_ep" /tmp/l.txt | cut -c1-110; cat /tmp/l.txt >> $OUT/intranode.log; }
lb apart --sms 16,24,32 --sides-apart
b split --sms 24 --send-sms 0,13,14,16
lb rings-apart --sms 24 --sides-apart --rings 2:3,2:4
lb one-way --sms 24 --one-way
b rings-2:3 --sms 24 --rings 2:3
lb stores-vs-bulk --sms 24 --send-sms 12 --copies both
