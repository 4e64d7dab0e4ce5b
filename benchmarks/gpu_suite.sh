#!/usr/bin/env bash
# One command for a GPU machine (an H100 / H200 with torch, triton and transformers installed; no
# network): the CUDA tests, the kernel benchmark, the end-to-end benchmark, a sweep of the factored
# tensor-core kernel's launch parameters and a profile of eager calls' host time, in about 8 minutes.
# Writes pytest.xml, bench_gpu.json, e2e_gpu.json, tune.json, profile.json and their logs to the
# folder given (default gpu-results/) and prints one summary. Run from the repository root, no install:
#
#     PYTHONPATH=. bash benchmarks/gpu_suite.sh gpu-results
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:-.}:." PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "# $name: rc $rc in $((SECONDS - start)) s (limit $limit s)"
}
$py -c "import torch, triton; print('# device:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)"
# CUDA tests, compiled in parallel (xdist when installed)
xdist=$($py -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
step pytest 165 $py -m pytest -q -p no:cacheprovider $xdist --junitxml="$out/pytest.xml" \
    tests/test_triton_kernels.py tests/test_gpu_layouts.py tests/test_layout_contract.py tests/test_checkpoint.py \
    tests/test_qat.py tests/test_optim.py -k "cuda or triton or gpu or stream"
step bench_gpu 90 $py benchmarks/bench_gpu.py --shapes 4096x4096,8192x8192,8192x28672,28672x8192 --m 1,4,16,64,128,1024 \
    --rounds 2 --reps 10 --json "$out/bench_gpu.json"
step e2e_gpu 120 $py benchmarks/bench_e2e_gpu.py --layers 4 --new-tokens 32 --rounds 2 --compile --json "$out/e2e_gpu.json"
step tune 80 $py benchmarks/tune_gpu_kernels.py --kernels factored --formats int4-g128 --shapes 8192x8192,8192x28672 \
    --m 1,16,64,128 --reps 10 --json "$out/tune.json"
step profile 40 $py benchmarks/profile_calls.py --calls 200 --json "$out/profile.json"
$py benchmarks/gpu_summary.py "$out" | tee "$out/summary.txt"
