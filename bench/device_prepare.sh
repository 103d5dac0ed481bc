#!/usr/bin/env bash
# On the dev machine, before device calls: what a lent GPU machine lacks, in folders git ignores, for the call's
# `carry`: [".deps", ".whl"]. Nothing here survives a session, so each session runs this once (~1 minute).
#   .deps/include: libfabric's headers (the device has the library, not its headers);
#   .whl: the build tools (scikit-build-core, nanobind) and the `gpu` extra (tokamax and the packages it imports)
#         as Python 3.12 wheels, plus .whl/shim: a stub for the one xprof module tokamax imports at import time
#         (its benchmarking; xprof's own chain is large and unused here).
# bench/device_run.sh installs the wheels into /tmp/site there; later commands of the same call set
#   export PYTHONPATH=/tmp/site:$PWD/.whl/shim
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && touch .git/info/exclude
grep -qx '/.deps/' .git/info/exclude || echo /.deps/ >> .git/info/exclude
if [ ! -d .deps/include/rdma ]; then
  mkdir -p .deps && (cd .deps && apt-get download libfabric-dev && dpkg -x libfabric-dev_*.deb ex \
    && rm -rf include && mv ex/usr/include include && rm -rf ex ./*.deb)
fi
mkdir -p .whl/shim/xprof/cli
# pydantic and pydantic-core are pinned together (pydantic names the one core it takes).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
  scikit-build-core nanobind pathspec packaging \
  tokamax==0.0.17 absl-py einshape qwix immutabledict tqdm annotated-types typing-inspection \
  "typing-extensions>=4.16" pydantic==2.14.4 pydantic-core==2.50.5
touch .whl/shim/xprof/__init__.py .whl/shim/xprof/cli/__init__.py
cat > .whl/shim/xprof/cli/tools.py <<'STUB'
def get_kernel_stats_tool(*args, **kwargs):  # tokamax imports it for its benchmarking only
    raise NotImplementedError("xprof is not carried to the device")
STUB
du -sh .deps .whl
