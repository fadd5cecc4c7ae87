#!/usr/bin/env bash
# Every GPU check of the CUDA path in one run, sized for a lent H100/H200 (under 10 minutes): the CUDA tests (graph
# replay against eager at every bucket, prompt chunks' graphs too, speculation against plain, the paged attention
# kernel against float64, launch-ahead against the step without it, the Triton linears' bits, with the norms in them
# too), bench/gpu_linear.py (each projection of the three shapes in bfloat16 on cuBLAS and on Triton's tiles, int8 and
# int4), then bench/cuda_decode.py on the three real shapes at batch 1 and 32 on graphs (launch-ahead on and off, the
# kernels of a batch-1 step; each shape with bfloat16 linears on Triton's tiles, with and without the residual adds
# and norms inside its projections, and with int4 weights; HF transformers and the dynamic path, measured in earlier
# runs, are left out for time). Results go to $OUT (the device tool's folder) or
# bench/results/gpu_check. Missing packages travel as wheels in .whl/ (the GPU image lacks gguf and pytest-xdist:
# `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0 pytest-xdist==3.8.0
# execnet==2.1.2`); .whl/ is ignored by git,
# so the device tool must carry it (carry=[".whl"]), and the run needs a timeout of about 590 s.
# Usage: bash bench/gpu_check.sh [SHAPES]   (SHAPES: bench/cuda_decode.py --shapes, default all three, the 7B first)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
# four test processes where pytest-xdist travels in .whl/: each compiles its own kernels, which a fresh machine's
# empty Triton cache makes most of the tests' time
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
timeout 140 python3 -m pytest -q -rs $workers tests/test_cuda.py tests/test_paged_attention.py tests/test_static_step.py \
    tests/test_triton_linear.py tests/test_triton_linear_norm.py tests/test_triton_ops.py tests/test_tile_tuning.py \
    2>&1 | tee "$OUT/tests.txt"
echo "tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
timeout 90 python3 bench/gpu_linear.py --name gpu_check_linear 2>&1 | tee "$OUT/linear.txt"
cp bench/results/gpu_check_linear.json "$OUT/" 2>/dev/null
# the 7B first: its batch-1 row is the target furthest from the mark, and a load that tunes Triton tiles (SmolLM2's and
# the 1.5B's, not the 7B's) compiles kernels, so the smaller shapes are the ones a timeout would cut
timeout 330 python3 bench/cuda_decode.py --shapes "${1:-qwen2.5-7b,qwen2.5-1.5b,smollm2-135m}" --no-hf --graphs-only --batches 1,32 --profile --kernels \
    --linears triton,int4 --linears-shapes smollm2-135m,qwen2.5-1.5b,qwen2.5-7b --norm-apart \
    --name gpu_check_decode 2>&1 | tee "$OUT/bench.txt"
cp bench/results/gpu_check_decode.json "$OUT/" 2>/dev/null
# the device tool brings back at most eight files: the profiles and kernel tables travel as one
for f in bench/results/gpu_check_decode_profile_*.txt bench/results/gpu_check_decode_kernels_*.txt; do
    [ -f "$f" ] && { echo "=== $f"; cat "$f"; }
done > "$OUT/details.txt"
echo "total: $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
