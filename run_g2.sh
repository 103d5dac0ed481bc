set -u
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tok/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/.tok/shim PYTHONUNBUFFERED=1
timeout 500 python .tok/probe/probe.py 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/probe.log | tail -60
