#!/usr/bin/env bash
# The CPU run of docs/results.md: every table of its CPU section, from one checkout, into one folder.
#   bash docs/results.sh [OUT] [VERL_PYTHON]
# OUT (default: a new temporary folder) gets one file per command (what it printed, the command on
# its first line), the load average before and after each, the date, the commit and the versions.
# VERL_PYTHON (default verl-venv/bin/python, see docs/integrations/verl.md#a-venv-for-verl) runs the
# rows of nested batches against verl's utilities and verl's own calls before and after install();
# without it those two are skipped. docs/bench.png is rewritten by the first command.
# One intra-op thread at a raised priority (nice -n -10 needs root; without it the plain priority
# is kept): a shared machine's other work then delays no second thread of a timed call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
VERL_PYTHON=${2:-verl-venv/bin/python}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
NICE=(nice -n -10)
"${NICE[@]}" true 2>/dev/null || NICE=()
date -u +%Y-%m-%dT%H:%MZ > "$OUT/date.txt"
git log -1 --format="%h %ad" --date=iso > "$OUT/commit.txt"
python -c "import torch, transformers, tensordict; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'tensordict', tensordict.__version__, 'threads', torch.get_num_threads())" > "$OUT/env.txt"
run() {
  local name=$1
  shift
  uptime > "$OUT/$name.load"
  echo "\$ $*" > "$OUT/$name.txt"
  "${NICE[@]}" "$@" >> "$OUT/$name.txt" 2> "$OUT/$name.err" || echo "failed: $name (see $OUT/$name.err)"
  uptime >> "$OUT/$name.load"
}
run all python -m nopad bench --all --repeats 30 --plot docs/bench.png
run model python -m nopad bench --model --repeats 5
run model_qwen3_5 python -m nopad bench --model --arch qwen3_5 --repeats 3
run model_bamba python -m nopad bench --model --arch bamba --repeats 3
run model_compile python -m nopad bench --model --compile --repeats 3 --bucket 64
run demo python -m nopad demo
if [ -x "$VERL_PYTHON" ]; then
  run batches_verl "$VERL_PYTHON" -m nopad bench --batches --batch-sizes 8 --repeats 7
  run verl_calls "$VERL_PYTHON" examples/verl_bench.py --batch-sizes 8 64 256 1024 --repeats 5 --thd-max-batch 1024
else
  echo "no $VERL_PYTHON: the two verl tables are skipped"
fi
echo "tables in $OUT"
