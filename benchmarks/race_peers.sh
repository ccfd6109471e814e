#!/bin/bash
# paged-chat against its peers on this machine, one run each, in the order the closing notes
# report them: llama.cpp's llama-server (1 slot for one chat, 32 for 32 chats), vLLM's CPU
# build (eager), quantized against dequantized weights, the cost of constrained decoding, and
# one chat's decode tokens/s (`ask --stats`, after the first token) beside llama-bench's tg64
# on the same file and threads.
# Every figure goes to OUT (default ./race-results) beside the machine's CPU and load.
# Needs the peers built: $PEERS/llama_cpp.sh build, $PEERS/vllm_cpu.sh setup (PEERS defaults
# to ../shared/peers). Run it on a quiet machine; it takes about 10 minutes.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-race-results}; PEERS=${PEERS:-../shared/peers}; mkdir -p "$OUT"
PY=.venv/bin/python; PC=.venv/bin/paged-chat
export HF_HUB_OFFLINE=1
GGUF=$($PY -c "from paged_chat.engine.models.loader import resolve_alias_path; print(resolve_alias_path('smollm2-135m'))")
BENCH=(--no-scenarios --dtype float32)
ONE_CHAT=(--chats 1 --min-output 256 --max-output 256)
(date; uptime; lscpu | grep -E "Model name|Flags"; git log --oneline -1) > "$OUT/machine.txt"
run() {  # run NAME COMMAND...: the load before it, then its output, into OUT/NAME.txt
    local name=$1; shift
    (uptime; timeout 900 "$@") > "$OUT/$name.txt" 2>&1
}
run probe $PY -m benchmarks.quant_kernel_probe --rows 1 32 --repeats 10
run decode_llama_bench "$("$PEERS/llama_cpp.sh" bin)/llama-bench" -m "$GGUF" -t 2 -p 0 -n 64 -r 5
run decode_paged_chat bash -c "for run in 1 2 3; do $PC ask --no-save --stats --max-tokens 64 \
    --temperature 0 'Write a story about a dragon.' 2>&1 | tail -1; done"
"$PEERS/llama_cpp.sh" start "$GGUF" 8080 1 > /dev/null
run llama_one_chat $PC bench --systems paged-chat,openai:http://127.0.0.1:8080 "${BENCH[@]}" "${ONE_CHAT[@]}"
"$PEERS/llama_cpp.sh" stop > /dev/null
"$PEERS/llama_cpp.sh" start "$GGUF" 8080 32 > /dev/null
run llama_32_chats $PC bench --systems paged-chat,openai:http://127.0.0.1:8080 "${BENCH[@]}"
"$PEERS/llama_cpp.sh" stop > /dev/null
DTYPE=float32 EAGER=1 "$PEERS/vllm_cpu.sh" start > /dev/null
run vllm_32_chats $PC bench --systems paged-chat,openai:http://127.0.0.1:8001 "${BENCH[@]}"
run vllm_one_chat $PC bench --systems paged-chat,openai:http://127.0.0.1:8001 "${BENCH[@]}" "${ONE_CHAT[@]}"
"$PEERS/vllm_cpu.sh" stop > /dev/null
run dequantized_32_chats $PC bench --systems paged-chat "${BENCH[@]}" --weights dequantize
run quantized_32_chats $PC bench --systems paged-chat "${BENCH[@]}"
run constrained $PY -m benchmarks.constrained_step --steps 24
date >> "$OUT/machine.txt"
grep -h -A3 "output_tokens_per_s" "$OUT"/*.txt
grep -h "tg64\|tokens/s" "$OUT"/decode_*.txt
