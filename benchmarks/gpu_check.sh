#!/bin/bash
# The GPU checklist (../shared/GPU.md) in one device call: `bash benchmarks/gpu_check.sh` with
# carry [".gpu", ".whl"]; every log lands in $OUT as it goes (about 380 s on an H100, plus the
# prefix-cache A/B).
cd "$(dirname "$0")/.."  # the repository root; .whl and .gpu as benchmarks/gpu.md step 1 makes them
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD SGL_TOKENIZER_DIR=$PWD/.gpu/tokenizer SGL_SHARED_DATA=$PWD/.gpu/data PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; nproc; } > $OUT/env.txt 2>&1
python3 -m benchmarks.random_model /tmp/l1b --shape llama3-1b > $OUT/model.log 2>&1 &
MODEL=$!
el tests; timeout 230 python3 -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tail -60 > $OUT/gpu_tests.log
wait $MODEL
el invariance; timeout 120 python3 -m benchmarks.invariance --model /tmp/l1b --device cuda --attention-backends flashinfer,triton --prompts 16 --new-tokens 8 > $OUT/invariance.log 2>&1
el json; timeout 100 python3 -m benchmarks.json_decode --model /tmp/l1b --device cuda > $OUT/json_decode.log 2>&1
el kernels; timeout 100 python3 -m benchmarks.invariance --kernels --device cuda --attention-backends triton,flashinfer > $OUT/kernels.log 2>&1
el engine; timeout 100 python3 -m benchmarks.engine --model /tmp/l1b --device cuda --dtypes bfloat16 --attention-backends flashinfer,triton --no-hf --batches 1,16,64,256 > $OUT/engine_1b.log 2>&1
el prefix; timeout 90 python3 -m benchmarks.prefix_cache --model /tmp/l1b --device cuda --repeats 1 > $OUT/prefix_cache.log 2>&1
el done
