#!/usr/bin/env bash
# GPU runner (offline GPU box, source checkout, no uv/nox): for each package named, run its
# test suite on the GPU, then its benchmark suite via ci/bench.py (rendered into
# packages/<p>/benchmarks/results/). Logs and results are copied to $OUT when it is set.
#
#   ci/gpu_run.sh act lrpe-rotate          # tests + benchmarks
#   TESTS_ONLY=1 ci/gpu_run.sh flash-attn  # tests only
#   BENCH_ONLY=1 ci/gpu_run.sh act         # benchmarks only
#   PYTEST_ARGS="-n 8" ci/gpu_run.sh act   # extra pytest arguments (pytest-xdist where installed)
#   BENCH_K="model or 32768" BENCH_ARGS=--merge ci/gpu_run.sh act  # a subset, merged into the
#                                          # committed results (BENCH_ARGS: more ci/bench.py args)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="shared/src$(for p in packages/*/src; do printf ':%s' "$p"; done)${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/kernelkit-gpu}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$out/gpu.txt"
status=0
for pkg in "$@"; do
  if [ -z "${BENCH_ONLY:-}" ]; then
    timeout "${TEST_TIMEOUT:-300}" python -m pytest -p kernelkit.shared.pytest_plugin \
      "packages/$pkg/tests" -q -p no:cacheprovider --timeout=120 ${PYTEST_ARGS:-} > "$out/$pkg-tests.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && status=$rc
    echo "$pkg tests: rc=$rc $(tail -1 "$out/$pkg-tests.log")"
  fi
  if [ -z "${TESTS_ONLY:-}" ]; then
    timeout -s INT -k 60 "${BENCH_TIMEOUT:-400}" python ci/bench.py "$pkg" ${BENCH_K:+-k "$BENCH_K"} ${BENCH_ARGS:-} > "$out/$pkg-bench.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && status=$rc
    echo "$pkg bench: rc=$rc"
    cp packages/"$pkg"/benchmarks/results/*.{json,md,png} "$out/" 2>/dev/null
    for f in "$out"/NVIDIA*.json "$out"/NVIDIA*.md "$out"/NVIDIA*.png; do
      [ -e "$f" ] && mv "$f" "$out/$pkg-$(basename "$f")"
    done
  fi
done
exit $status
