#!/usr/bin/env bash
# One call on the GPU machine (device tool): the GPU benchmarks in priority order, each given at most its share of
# a total deadline, each writing its section of bench/RESULTS.md as it finishes. Logs and RESULTS.md go to $OUT.
#   QWEN35_COMMIT=<sha> bash bench/gpu_session.sh [TOTAL_SECONDS] [SECTIONS...]
# Sections: kernels throughput serving profile tp9b tp27b. Single-GPU sections run on GPU 0.
set -u
total=${1:-560}; shift || true
sections=${*:-kernels throughput serving profile tp9b}
start=$(date +%s)
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 FLA_TILELANG=0 QWEN35_COMMIT=${QWEN35_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
xla=/tmp/qwen35-xla; mkdir -p $xla
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
left() { echo $(( total - ($(date +%s) - start) )); }
run() {   # name share_seconds command...
  local name=$1 share=$2; shift 2
  local budget=$(( $(left) < share ? $(left) : share ))
  if [ "$budget" -lt 20 ]; then echo "=== $name skipped (no time left)"; return; fi
  echo "=== $name (limit ${budget}s) at +$(( $(date +%s) - start ))s"
  timeout --signal=TERM --kill-after=10 "$budget" "$@" > "$out/$name.log" 2>&1
  echo "--- $name rc=$? after $(( $(date +%s) - start ))s"; grep -v "precompiling\|loading weights" "$out/$name.log" | tail -n 25
}
for s in $sections; do
  case $s in
    kernels) CUDA_VISIBLE_DEVICES=0 run kernels 170 python3 bench/kernels.py --time-limit 150 ;;
    throughput) CUDA_VISIBLE_DEVICES=0 run throughput 170 python3 bench/throughput.py --record \
                  --compilation-cache-dir $xla/engine ;;
    serving) CUDA_VISIBLE_DEVICES=0 run serving 150 python3 bench/serving.py --compare \
               --config bench/configs/qwen3.5-9b.json --num-prompts 32 --input-len 1024 --output-len 256 \
               --max-concurrency 16 --ignore-eos --result-file "$out/serving.json" --record -- \
               --max-model-len 1536 --max-num-seqs 64 --max-num-batched-tokens 2048 --max-prefill-rows 2 \
               --compilation-cache-dir $xla/engine ;;
    profile) CUDA_VISIBLE_DEVICES=0 run profile 80 python3 -m qwen35_jax.profile --config bench/configs/qwen3.5-9b.json \
               --random-weights --batch 16 --prompt-len 512 --decode-steps 8 --out /tmp/prof --append-results \
               --compilation-cache-dir $xla/profile \
             && tar czf "$out/profile_trace.tgz" -C /tmp prof 2>/dev/null ;;
    tp9b) run tp9b 200 python3 bench/tp.py --configs bench/configs/qwen3.5-9b.json --tp 2 --record ;;
    tp27b) run tp27b 300 python3 bench/tp.py --configs bench/configs/qwen3.5-27b.json --tp 2 --batches 1,16 --record ;;
  esac
done
cp bench/RESULTS.md "$out/RESULTS.md"
echo "session done after $(( $(date +%s) - start ))s"
