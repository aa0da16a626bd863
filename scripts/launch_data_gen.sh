#!/usr/bin/env bash
# data-gen at scale: N inference servers (vllm serve or SGLang) per node, one data-gen rank per server, the
# prompts sharded across all ranks (rank r of W takes chunks r, r+W, ...; the last rank to finish merges) and,
# with hidden_states=true, the hidden-state shards too (rank r captures shards r, r+W, ...; the last rank to
# finish writes the index and the manifest).
# Run it once on every node with the same arguments and NODE_RANK = 0 .. NNODES-1; out= must be on a
# filesystem every node sees.
#
#   MODEL=meta-llama/Llama-3.1-8B-Instruct NNODES=2 NODE_RANK=0 GPUS_PER_NODE=8 bash scripts/launch_data_gen.sh \
#       target=hf target.name=meta-llama/Llama-3.1-8B-Instruct prompts=sharegpt prompts.path=/shared/sharegpt.jsonl \
#       out=/shared/runs/llama8b-data
#
#   MODEL        what the servers serve (required): the target's Hub id or folder, as in target.name
#   ENGINE       vllm (default) | sglang
#   TP           GPUs per server (tensor parallel, default 1); SERVERS = GPUS_PER_NODE / TP per node
#   BASE_PORT    server i of a node listens on BASE_PORT + i (default 8000)
#   SERVER_ARGS  extra arguments for every server, e.g. "--gpu-memory-utilization 0.6" to leave room on the GPU
#                for the target's copy that captures hidden states
#   DRY_RUN=1    print the exact command lines (servers and data-gen ranks) and run nothing
#
# Every rank calls data-gen with backend=openai and its own server's URL; the other overrides are passed
# through. Regeneration runs on the servers, so without hidden states a rank loads only the target's tokenizer
# and config, never its weights. With hidden_states=true (and target.device=cuda) every rank loads the target
# on GPU LOCAL_RANK of its node (LOCAL_RANK = its server's index) once the merged tokenized set is there, and
# captures its shards beside the running servers (see SERVER_ARGS). The servers are stopped when the ranks of
# this node are done.
set -euo pipefail

gpu_count() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
    [ "$n" -ge 1 ] 2>/dev/null && echo "$n" || echo 1
}

if [ -z "${MODEL:-}" ]; then
    echo "launch_data_gen.sh: set MODEL=<the target's Hub id or folder> (what the servers serve)." >&2
    exit 2
fi
ENGINE=${ENGINE:-vllm}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(gpu_count)}
TP=${TP:-1}
BASE_PORT=${BASE_PORT:-8000}
SERVER_WAIT_S=${SERVER_WAIT_S:-1800}
read -r -a SERVER_EXTRA <<<"${SERVER_ARGS:-}"
SERVERS=$((GPUS_PER_NODE / TP))
if [ "$SERVERS" -lt 1 ]; then
    echo "launch_data_gen.sh: TP=$TP is more than the node's $GPUS_PER_NODE GPUs." >&2
    exit 2
fi
WORLD=$((NNODES * SERVERS))

server_command() { # server_command <index on this node>
    local i=$1 gpus port=$((BASE_PORT + $1))
    gpus=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
    printf 'env CUDA_VISIBLE_DEVICES=%s ' "$gpus" # digits and commas: nothing to quote
    case "$ENGINE" in
        vllm) printf '%q ' vllm serve "$MODEL" --port "$port" --tensor-parallel-size "$TP" \
            ${SERVER_EXTRA[@]+"${SERVER_EXTRA[@]}"} ;;
        sglang) printf '%q ' python -m sglang.launch_server --model-path "$MODEL" --port "$port" --tp-size "$TP" \
            ${SERVER_EXTRA[@]+"${SERVER_EXTRA[@]}"} ;;
        *) echo "launch_data_gen.sh: ENGINE=$ENGINE is not vllm or sglang." >&2; exit 2 ;;
    esac
}

rank_command() { # rank_command <node> <index on the node> <overrides...>
    local node=$1 i=$2
    shift 2
    printf '%q ' env RANK=$((node * SERVERS + i)) LOCAL_RANK="$i" WORLD_SIZE="$WORLD" draftsmith data-gen "$@" \
        backend=openai "backend.url=http://127.0.0.1:$((BASE_PORT + i))/v1"
}

if [ "${DRY_RUN:-0}" = 1 ]; then
    for ((node = 0; node < NNODES; node++)); do
        echo "# node $node of $NNODES: $SERVERS $ENGINE server(s) x $TP GPU(s), ranks $((node * SERVERS))..$((node * SERVERS + SERVERS - 1)) of $WORLD"
        for ((i = 0; i < SERVERS; i++)); do server_command "$i" | sed 's/ $/ \&/'; echo; done
        echo "# (then wait until every server answers GET /v1/models)"
        for ((i = 0; i < SERVERS; i++)); do rank_command "$node" "$i" "$@" | sed 's/ $/ \&/'; echo; done
        echo "wait"
    done
    exit 0
fi

pids=()
# shellcheck disable=SC2317  # called by the EXIT trap
# shellcheck disable=SC2329  # invoked by the EXIT trap below
stop_servers() { # only the servers this script started
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop_servers EXIT
for ((i = 0; i < SERVERS; i++)); do
    eval "$(server_command "$i")" &
    pids+=($!)
done
for ((i = 0; i < SERVERS; i++)); do # wait until every server answers /v1/models
    url="http://127.0.0.1:$((BASE_PORT + i))/v1/models"
    for ((t = 0; t < SERVER_WAIT_S; t += 5)); do
        if python -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=5)" "$url" 2>/dev/null; then break; fi
        sleep 5
    done
done
ranks=()
for ((i = 0; i < SERVERS; i++)); do
    eval "$(rank_command "$NODE_RANK" "$i" "$@")" &
    ranks+=($!)
done
status=0
for pid in "${ranks[@]}"; do wait "$pid" || status=1; done
exit "$status"
