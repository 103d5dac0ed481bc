#!/usr/bin/env bash
# One call on a lent GPU machine: build this tree against the preinstalled jax, run the GPU tests, then the
# benchmarks named in BENCHES (default: intranode low_latency proxy_gpu). Logs go to $OUT; the tables are printed last.
#   usage (from the repo root, on the device): bash bench/device_run.sh [tests|bench|all|none] [bench args...]
#   e.g. TESTS=tests/test_gpu.py TEST_SELECT=low_latency BENCHES=low_latency bash bench/device_run.sh all
#   other benches: BENCHES="decode_step train_step" (train_step takes minutes)
# The whole tests/test_gpu.py at R = 4 takes ~1000 s on 4x H200, past one call's 600 s; three selections fit a call
# each (2026-11-28: ~300, ~275 and ~435 s; TEST_TIMEOUT=560, build ~45 s):
#   "one_process_drives_all_gpus or normal_mode_variants"
#   "one_process_per_gpu or separate_nodes_over_the_proxy or staged_through"
#   "two_level or bad_expert or drives_gpus_on_separate_nodes or kernel_sends or missing_peer or soak or
#    low_latency_variants or loopback or copy_bench"
# At R = 2 (2x H200, 2026-11-30) the whole file is ~600 s in three selections: "(one_process_drives_all_gpus or
# one_process_per_gpu) and normal or normal_mode_variants" (~200 s), "separate_nodes_over_the_proxy or staged_through
# or two_level" (~225 s), and the rest (~220 s).
# To read a sweep as a fixed cost and a copy rate (ours and NCCL's): bench/fixed_cost.py over intranode.py's --out files
# of one lease at two sizes at least (V3's and the layer's: --tokens 4096 --hidden 2048 --topk 8 --experts 64).
# The device tool returns at most 8 files from $OUT: a call that writes more (a setup log, several benches) packs them
# last, e.g. `cd $OUT && tar czf /tmp/all.tgz . && rm -f *.json *.log && mv /tmp/all.tgz .`.
# After a change to a kernel (its code layout may split a warp at a barrier): TESTS=tests/test_synccheck_gpu.py,
# one GPU, compute-sanitizer synccheck on the expert-layout dispatch, pulled and sent.
#
# The GPU machine has no package registry and (seen 2026-11-22) neither libfabric headers, scikit-build-core nor
# tokamax. bench/device_prepare.sh puts them on the dev machine in folders git ignores; name them in the device
# call's `carry`: [".deps", ".whl"]. The wheels go into /tmp/site; commands after this script in the same call set
#   export PYTHONPATH=/tmp/site:$PWD/.whl/shim
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/uccl_ep_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1

# libfabric headers may be missing there: use the ones carried in .deps/ with the system's library.
if ! pkg-config --exists libfabric 2>/dev/null; then
  lib=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
  mkdir -p .deps/lib .deps/pkgconfig
  ln -sf "$lib" .deps/lib/libfabric.so
  printf 'Name: libfabric\nDescription: carried headers\nVersion: 1.17.0\nCflags: -I%s\nLibs: -L%s -lfabric\n' \
    "$PWD/.deps/include" "$PWD/.deps/lib" > .deps/pkgconfig/libfabric.pc
  export PKG_CONFIG_PATH=$PWD/.deps/pkgconfig
  echo "# libfabric: carried headers, system library $lib"
fi
# Build tools and the `gpu` extra missing there travel as wheels in .whl/ (bench/device_prepare.sh).
if ls .whl/*.whl > /dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD/.whl/shim
  echo "# carried wheels: $(ls .whl/*.whl | wc -l), in /tmp/site"
fi
echo "# $(which python) $(python -m pip --version)"
python -c "import jax, jaxlib; print('# jax', jax.__version__)"; cmake --version | head -1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
start=$(date +%s)
if [ -n "${SKIP_BUILD:-}" ]; then :  # a later step of the same call: the tree is installed already
elif ! python -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "# build: $(( $(date +%s) - start )) s"

if [ "$what" = tests ] || [ "$what" = all ]; then
  start=$(date +%s)
  timeout ${TEST_TIMEOUT:-300} python -m pytest -q -x ${TESTS:-tests/test_gpu.py} ${TEST_SELECT:+-k "$TEST_SELECT"} 2>&1 \
    | tee "$OUT/tests.log" | tail -40
  echo "# gpu tests: $(( $(date +%s) - start )) s"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # Bound every run (a stuck run must not eat the device time).
  for b in ${BENCHES:-intranode low_latency proxy_gpu}; do
    timeout ${BENCH_TIMEOUT:-240} python bench/$b.py --out "$OUT/$b.json" "$@" 2>&1 | tee "$OUT/$b.log" | tail -16
  done
fi
