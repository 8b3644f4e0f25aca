#!/usr/bin/env bash
# The GPU checks of the open issues as one script, for a session lent a GPU machine (../shared/GPU.md).
#
#   scripts/gpu_session.sh prepare [PYTHON_VERSION]   here: the wheels that machine lacks, into .gpu-wheels/
#                                                     (PYTHON_VERSION: the device's Python, 3.12 by default)
#   scripts/gpu_session.sh run [tests|bench|all]      there: the CUDA tests, then the GPU benchmarks; logs and
#                                                     results go to $OUT (the device tool brings them back)
#
# Run it there through the device tool with carry [".gpu-wheels"] and a timeout that leaves time to rerun:
# `run tests` takes about 3 minutes; `run bench` needs a call of its own (up to 12 minutes: split it there if the
# budget is short, e.g. by running benchmarks/run_all.py gpu_training alone).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
LACKING=(pyzmq orjson google-crc32c "protobuf>=7.35" msgspec)

prepare() {
    local version=${1:-3.12}
    mkdir -p "$WHEELS"
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$version" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${LACKING[@]}"
    ls -l "$WHEELS"
}

setup() {
    local site=${TMPDIR:-/tmp}/shardflow-site
    if [ -d "$WHEELS" ]; then
        python3 -m pip install --quiet --no-index --no-deps --target "$site" "$WHEELS"/*.whl
    fi
    export PYTHONPATH="$site:$PWD/src"
    OUT=${OUT:-$PWD/gpu-out}
    mkdir -p "$OUT"
    { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
      python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count())'
      nproc; } | tee "$OUT/machine.txt"
}

cuda_tests() {
    # Every test that needs CUDA, and the integration tests whose workers take the GPU by default where they see one.
    timeout 300 python3 -m pytest -q -p no:cacheprovider -x --timeout 120 \
        tests/train/test_allreduce_device.py tests/train/test_device.py tests/ps/test_wire_precision.py \
        tests/data/test_torch_edge.py tests/integration/test_allreduce_strategy.py \
        2>&1 | tee "$OUT/cuda_tests.txt" | tail -30
}

bench() {
    # Issue 21's GPU table (stored: benchmarks/results/gpu_training.json and BENCHMARKS.md), then issue 20's
    # 2 workers + 2 PS against the one-process loop on that machine's cores (TensorFlow is not there: --no-tf).
    timeout 420 python3 benchmarks/run_all.py gpu_training 2>&1 | tee "$OUT/gpu_training.txt" | tail -30 || true
    cp benchmarks/results/gpu_training.json BENCHMARKS.md "$OUT/" 2>/dev/null || true
    timeout 300 python3 benchmarks/embedding_tables.py --no-tf --repeats 1 2>&1 | tee "$OUT/embedding_tables.txt" \
        | tail -20 || true
}

case "${1:-}" in
    prepare) prepare "${2:-}" ;;
    run)
        setup
        case "${2:-all}" in
            tests) cuda_tests ;;
            bench) bench ;;
            all) cuda_tests; bench ;;
            *) echo "run what? tests, bench or all" >&2; exit 2 ;;
        esac ;;
    *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
