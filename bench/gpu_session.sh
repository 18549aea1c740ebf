#!/usr/bin/env bash
# One call on the GPU machine (device tool): the GPU benchmarks in priority order, each given at most its share of
# a total deadline, each recording its run under bench/runs/ (a JSON file, a section appended to history.md) as it
# finishes. Everything it writes is packed into $OUT/session.tgz after every section (the device tool returns at
# most 8 files), with history.md beside it; back home: python bench/results.py merge <history.md> <session/runs>.
#   QWEN35_COMMIT=<sha> bash bench/gpu_session.sh TOTAL_SECONDS SECTION...
# Sections: attention kernels kheadline parts enginecheck kmodel kconv kdecode sampler throughput
#   throughput_staged serving servinglite profile
#   profile64 profile64pick profile64envs ab abtrees profiletp tp9b tpflags tp27b structured hostprofile speccost speccost27 specmodel
#   multiturn longttft longdecode longtpotab longsteps chunktiles longtpotpick moe35 moecheck moeprofile prefillprofile
#   lmhead ttftab gemv gemmlayout.
# Single-GPU sections run on GPU 0.
# .whl/ (git-ignored, carried) holds the wheels the GPU machine lacks, installed into /tmp/site: llguidance 1.9.1
# (structured), fla-core and flash-linear-attention 0.6.0 (HF + fla baselines: the H100 machines have no fla), from
#   pip download --no-deps --only-binary=:all: -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0
# XLA_FLAGS from the environment applies to every section (e.g. --xla_gpu_autotune_level=0 to cut compile time).
# The default sections need ~930 s: over two device calls (600 s each at most), e.g.
#   bash bench/gpu_session.sh 560 attention throughput;  bash bench/gpu_session.sh 560 servinglite profile kernels
# (throughput's cold precompile sweep alone took 215 s at 8e46b99: 23 executables).
set -u
total=${1:-560}; shift || true
sections=${*:-attention throughput servinglite profile kernels}
start=$(date +%s)
out=${OUT:-/tmp/out}; mkdir -p "$out"
work=/tmp/session; mkdir -p $work
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 FLA_TILELANG=0 QWEN35_COMMIT=${QWEN35_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
xla=/tmp/qwen35-xla; mkdir -p $xla
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
left() { echo $(( total - ($(date +%s) - start) )); }
pack() { mkdir -p $work/runs; cp bench/runs/*.json $work/runs/ 2>/dev/null
         tar czf "$out/session.tgz" -C /tmp session; cp bench/runs/history.md "$out/"; }
run() {   # name share_seconds command...
  local name=$1 share=$2; shift 2
  local budget=$(( $(left) < share ? $(left) : share ))
  if [ "$budget" -lt 30 ]; then echo "=== $name skipped (no time left)"; return; fi
  echo "=== $name (limit ${budget}s) at +$(( $(date +%s) - start ))s"
  timeout --signal=TERM --kill-after=10 "$budget" "$@" > "$work/$name.log" 2>&1
  echo "--- $name rc=$? after $(( $(date +%s) - start ))s"
  grep -v "precompiling\|loading weights\|^W1\|^I1" "$work/$name.log" | tail -n 22
  pack
}
engine_flags="--max-model-len 1536 --max-num-seqs 64 --max-num-batched-tokens 2048 --max-prefill-rows 2"
lite_flags="--max-model-len 1536 --max-num-seqs 16 --max-num-batched-tokens 1024 --max-prefill-rows 1"
for s in $sections; do
  case $s in
    attention) CUDA_VISIBLE_DEVICES=0 run attention 200 python3 bench/attention.py --record --batches 16,64 \
                 --contexts 1024,4096 --pick $work/pick.txt ;;       # the pick feeds profile64pick
    kernels) OUT=$work/kernels CUDA_VISIBLE_DEVICES=0 run kernels 200 python3 bench/kernels.py --time-limit 165 ;;
    kheadline) OUT=$work/kheadline CUDA_VISIBLE_DEVICES=0 run kheadline 330 python3 bench/kernels.py --time-limit 290 \
                 --no-model --only correct_defaults headline prefill_cases ;;
    parts) for c in ${PARTS_CASES:-1x8k}; do       # PARTS: which parts; PARTS_CASES: e.g. "1x8k 8x2k";
             # PARTS_WHOLE / PARTS_KERNELS: the whole / kernels parts' configurations (prefill_parts.py --whole)
             OUT=$work/parts CUDA_VISIBLE_DEVICES=0 run parts_$c 240 python3 bench/prefill_parts.py --record --case $c \
               ${PARTS:+--parts $PARTS} ${PARTS_WHOLE+--whole "$PARTS_WHOLE"} ${PARTS_KERNELS+--kernels "$PARTS_KERNELS"}
           done ;;
    enginecheck) CUDA_VISIBLE_DEVICES=0 run enginecheck 150 python3 bench/engine_check.py --record ;;   # pallas vs ref.
    kmodel) OUT=$work/kmodel CUDA_VISIBLE_DEVICES=0 run kmodel 220 python3 bench/kernels.py --time-limit 200 \
              --only correct_defaults model_step ;;   # the 9B-shaped decode step, pallas vs reference backends
    kconv) OUT=$work/kconv CUDA_VISIBLE_DEVICES=0 run kconv 150 python3 bench/kernels.py --time-limit 130 --no-model \
             --only correct_defaults conv ;;          # the conv kernels' sweep against fla's
    kdecode) OUT=$work/kdecode CUDA_VISIBLE_DEVICES=0 run kdecode 150 python3 bench/kernels.py --time-limit 130 \
               --decode-batches 1 64 256 --only correct_defaults correct_decode decode_cases decode_sweep ;;
    sampler) # an earlier sampler to time beside this one, left untracked (it travels with the tree), e.g.
             #   git show <commit>:qwen35_jax/engine/sampler.py > bench/_old_sampler.py
             old=$( [ -f bench/_old_sampler.py ] && echo "--old bench/_old_sampler.py" )
             CUDA_VISIBLE_DEVICES=0 run sampler 90 python3 bench/sampler.py --record $old ;;
    throughput) CUDA_VISIBLE_DEVICES=0 run throughput 380 python3 bench/throughput.py --record \
                  --compilation-cache-dir $xla/engine ;;
    throughput_staged) CUDA_VISIBLE_DEVICES=0 run throughput_staged 240 python3 bench/throughput.py --record \
                         --kernel-config staged_inputs=true --compilation-cache-dir $xla/engine ;;   # after throughput: its XLA cache
    serving) CUDA_VISIBLE_DEVICES=0 run serving 130 python3 bench/serving.py --compare \
               --config bench/configs/qwen3.5-9b.json --num-prompts 32 --input-len 1024 --output-len 256 \
               --max-concurrency 16 --ignore-eos --result-file "$work/serving.json" --record -- \
               $engine_flags --compilation-cache-dir $xla/engine ;;
    servinglite) CUDA_VISIBLE_DEVICES=0 run serving 170 python3 bench/serving.py --compare \
               --config bench/configs/qwen3.5-9b.json --num-prompts 16 --input-len 1024 --output-len 256 \
               --max-concurrency 16 --ignore-eos --result-file "$work/serving.json" --record -- \
               $lite_flags --compilation-cache-dir $xla/lite ;;
    profile) CUDA_VISIBLE_DEVICES=0 run profile 80 python3 bench/profile.py --config bench/configs/qwen3.5-9b.json \
               --random-weights --batch 16 --prompt-len 512 --decode-steps 8 --out /tmp/prof \
               --compilation-cache-dir $xla/profile --top-unattributed 25
             # trace, HLO and metadata come back too: qwen35_jax.tools.profile.load_report(session dir) re-reads them
             tar czf "$out/prof.tgz" -C /tmp prof ;;
    profile64|profile64pick)     # the 9B step at batch 64; profile64pick with the KernelConfig fields `attention` picked
             pick=$( [ $s = profile64pick ] && [ -f $work/pick.txt ] && cat $work/pick.txt )
             if [ $s = profile64pick ] && [ -z "$pick" ]; then echo "=== $s skipped (no pick)"; continue; fi
             CUDA_VISIBLE_DEVICES=0 run $s ${PROFILE64_SHARE:-110} \
               python3 bench/profile.py --config bench/configs/qwen3.5-9b.json --random-weights --batch 64 \
               --prompt-len 1024 --decode-steps 8 --out /tmp/$s --compilation-cache-dir $xla/$s --kernel-config "$pick" \
               --top-unattributed 5 ${PROFILE64_ARGS:-}      # e.g. PROFILE64_ARGS=--greedy
             (cd /tmp && tar czf "$out/$s${XLA_FLAGS:+-flags}-hlo.tgz" $(find $s -name "*.hlo.txt")) ;;   # the optimised HLO comes back
    profile64envs)   # the batch-64 profile once per entry of PROFILE64_ENVS (';'-separated; each entry is what `export`
                     # takes, e.g. 'XLA_FLAGS="--xla_a --xla_b"'; an empty entry: as is; kernel variants: PROFILE64_ARGS
                     # with --kernel-config)
             IFS=';' read -ra envsets <<< "${PROFILE64_ENVS:-}"
             for i in "${!envsets[@]}"; do
               CUDA_VISIBLE_DEVICES=0 run profile64_e$i ${PROFILE64_SHARE:-110} bash -c "${envsets[$i]:+export ${envsets[$i]};} exec \
                 python3 bench/profile.py --config bench/configs/qwen3.5-9b.json --random-weights --batch 64 \
                 --prompt-len 1024 --decode-steps 8 --out /tmp/profile64_e$i \
                 --compilation-cache-dir $xla/profile64_e$i --top-unattributed 8 ${PROFILE64_ARGS:-}"
               # the whole session comes back (trace, HLO, profile.json): qwen35_jax.tools.profile.load_report re-reads it
               tar czf "$out/profile64_e$i.tgz" -C /tmp profile64_e$i
             done ;;
    ab)  # decode-step A/B of kernel variants in one process (bench/ab_decode.py); AB_VARIANTS: ';'-separated
         # variants after the default, each space-separated KernelConfig field=value settings (bench/ab_decode.py)
         IFS=';' read -ra abv <<< "${AB_VARIANTS:?ab needs AB_VARIANTS}"
         CUDA_VISIBLE_DEVICES=0 run ab ${AB_SHARE:-240} python3 bench/ab_decode.py --record --batches ${AB_BATCHES:-16,64} \
           --config bench/configs/${AB_CONFIG:-qwen3.5-9b.json} --variants "" "${abv[@]}" ;;
    abtrees)  # ab_commit.py of each untracked tree in AB_TREES (bench/ab_tree.sh made them) against this one, at
              # AB_CONFIG shapes and AB_BATCHES, AB_ROUNDS rounds each, AB_ARGS more of its arguments
         for t in ${AB_TREES:?abtrees needs AB_TREES}; do
           CUDA_VISIBLE_DEVICES=0 run abtree_$(basename $t) ${AB_SHARE:-240} python3 bench/ab_commit.py --record \
             --base $PWD/$t --config $PWD/bench/configs/${AB_CONFIG:-qwen3.5-9b.json} --batches ${AB_BATCHES:-1} \
             --prefill-tokens 0 --rounds ${AB_ROUNDS:-2} ${AB_ARGS:-}
         done ;;
    profiletp) run profiletp 90 python3 bench/profile.py --config bench/configs/qwen3.5-9b.json --tp 2 \
               --random-weights --batch 16 --prompt-len 512 --decode-steps 8 --out /tmp/proftp \
               --compilation-cache-dir $xla/profiletp --top-unattributed 25
               tar czf "$out/proftp.tgz" -C /tmp proftp ;;
    tp9b) XLA_FLAGS="${TP_XLA_FLAGS:-${XLA_FLAGS:-}}" run tp9b 210 python3 bench/tp.py \
            --configs bench/configs/qwen3.5-9b.json --tp 2 --no-precompile --record ;;
    tpflags) tpf="python3 bench/tp.py --configs bench/configs/qwen3.5-9b.json --tp 2 --batches 1,16 --no-precompile --record"
             nccl="--xla_gpu_experimental_use_collective_kernels=-ALL_REDUCE"      # NCCL all-reduces, not XLA's kernels
             XLA_FLAGS="$nccl --xla_gpu_enable_command_buffer=+COLLECTIVES" run tpflags_nccl_graph 150 $tpf
             XLA_FLAGS="$nccl" run tpflags_nccl 150 $tpf ;;
    structured)   # needs the llguidance wheel in .whl; first the 248,320-token tokenizer (carried gzipped in
                  # .bench_tok/tokenizer.json.gz, else trained on the machine's Python sources, with the mask cost
                  # on this host's CPU), then decode with every row constrained
             tok=/tmp/qwen35-bench-tokenizer; mkdir -p $tok; lscpu | grep -m1 "Model name"   # masks are host work
             [ -f .bench_tok/tokenizer.json.gz ] && gunzip -c .bench_tok/tokenizer.json.gz > $tok/tokenizer.json
             [ -f $tok/tokenizer.json ] || CUDA_VISIBLE_DEVICES=0 run grammar_mask 200 python3 bench/grammar_mask.py \
               --engines llguidance --threads 8 --out bench/runs/grammar-mask-h200-host.json
             CUDA_VISIBLE_DEVICES=0 run structured ${ST_SHARE:-360} python3 bench/structured.py --record \
               --config bench/configs/qwen3.5-9b.json --tokenizer /tmp/qwen35-bench-tokenizer --rows 16 64 ;;
    hostprofile)  # cProfile of the engine thread in 9B decode at 64 rows, unconstrained (HP_SCHEMA: a constrained
                  # bench/structured.py schema instead); needs the bench tokenizer as structured does
             tok=/tmp/qwen35-bench-tokenizer; mkdir -p $tok
             [ -f .bench_tok/tokenizer.json.gz ] && gunzip -c .bench_tok/tokenizer.json.gz > $tok/tokenizer.json
             CUDA_VISIBLE_DEVICES=0 run hostprofile ${HP_SHARE:-150} python3 bench/host_profile.py \
               --config bench/configs/qwen3.5-9b.json --tokenizer $tok --rows ${HP_ROWS:-64} ${HP_SCHEMA:+--schema $HP_SCHEMA}
             cp $work/hostprofile.log "$out/" ;;
    speccost)    # speculative decoding's step and its parts against a plain one (SC_CONFIG shapes, default 9B;
                 # SC_K drafts; SC_BATCHES)
             CUDA_VISIBLE_DEVICES=0 run speccost ${SC_SHARE:-420} python3 bench/spec_cost.py --record \
               --config bench/configs/${SC_CONFIG:-qwen3.5-9b.json} --k ${SC_K:-3} --batches ${SC_BATCHES:-1 16 64} \
               ${SC_PROFILE:+--profile /tmp/specprof --profile-batches $SC_PROFILE} ;;   # SC_PROFILE: batches to trace
    speccost27)  # the same at 27B shapes, batches 1 16 (64 rows of three state pools do not fit beside the weights;
                 # 16 ran out of an 80 GB card under JAX's default 75%, now 95%)
             CUDA_VISIBLE_DEVICES=0 run speccost27 ${SC27_SHARE:-420} python3 bench/spec_cost.py --record \
               --config bench/configs/qwen3.5-27b.json --k ${SC_K:-3} --batches 1 16 ;;
    specmodel)   # the trained default model: acceptance and LLM.generate wall clock with and without drafts
             CUDA_VISIBLE_DEVICES=0 run specmodel ${SM_SHARE:-240} python3 bench/speculative.py --record \
               --docs ${SM_DOCS:-16} --k ${SM_K:-1 2 3 4} --temperatures 0 1 ;;
    longttft)    # issue 39: TTFT 8k..262k, prefill kernel vs jnp attention vs HF + fla, against the compute floor
                 # (LT_ARGS: more long_context.py arguments, split on spaces, e.g. --hf-lens= --jnp-max 0)
             CUDA_VISIBLE_DEVICES=0 run longttft ${LT_SHARE:-540} python3 bench/long_context.py --record \
               --config bench/configs/qwen3.5-9b.json --parts ${LT_PARTS:-tiles,ttft} ${LT_LENS:+--lens $LT_LENS} ${LT_ARGS:-} ;;
    longdecode)  # issue 39: decode at 128k of context; TPOT of 16 rows while a 128k prompt prefills, per budget
                 # (LD_ARGS: more long_context.py arguments, e.g. --prefix-caching --tpot-steps mixed)
             CUDA_VISIBLE_DEVICES=0 run longdecode ${LD_SHARE:-540} python3 bench/long_context.py --record \
               --config bench/configs/qwen3.5-9b.json --parts ${LD_PARTS:-decode,tpot} ${LD_BUDGETS:+--budgets $LD_BUDGETS} ${LD_ARGS:-} ;;
    longtpotab)  # issue 39: the mixed steps' GEMMs as XLA chooses (the default) and with Triton GEMMs off (as the
                 # prefill buckets compile; every executable of that run then has them off), one engine each
             for kc in "" "xla_options.xla_gpu_enable_triton_gemm=false"; do
               CUDA_VISIBLE_DEVICES=0 run longtpot${kc:+_no_triton} ${LTA_SHARE:-240} python3 bench/long_context.py \
                 --record --config bench/configs/qwen3.5-9b.json --parts tpot --budgets ${LD_BUDGETS:-64} \
                 ${kc:+--kernel-config $kc}
             done ;;
    longsteps)   # issue 39: the mixed step against the decode step and the chunk alone at 1k and 128k, and its
                 # device time per block (a traced burst)
             CUDA_VISIBLE_DEVICES=0 run longsteps ${LS_SHARE:-240} python3 bench/long_context.py --record \
               --config bench/configs/qwen3.5-9b.json --parts steps --steps-profile /tmp/steps_trace ;;
    chunktiles)  # issue 39: the prefill attention's tiles on a mixed step's short chunks at 128k; the pick feeds
                 # longtpotpick
             CUDA_VISIBLE_DEVICES=0 run chunktiles ${CT_SHARE:-150} python3 bench/long_context.py --record \
               --config bench/configs/qwen3.5-9b.json --parts chunktiles --pick $work/pfa_pick.txt ;;
    longtpotpick)  # issue 39: the mixed step at 128k against its parts, then TPOT during a 128k prefill with mixed
                   # steps (LD_BUDGETS caps), on chunktiles' pick of the prefill attention's tiles
             pick=$(cat $work/pfa_pick.txt 2>/dev/null)
             CUDA_VISIBLE_DEVICES=0 run longtpotpick ${LTP_SHARE:-360} python3 bench/long_context.py --record \
               --config bench/configs/qwen3.5-9b.json --parts tpot,steps --budgets ${LD_BUDGETS:-32,64} \
               --tpot-steps mixed --steps-contexts 131072 --steps-chunks 32,64 ${pick:+--kernel-config "$pick"} ;;
    moe35)       # issue 40: 35B-A3B decode at batch 1 / 16 / 64 / 256 against its routed-expert floor, and HF (~69 GB
                 # of weights: 256 rows' state fits beside them on an H200; on an 80 GB card the engine's default
                 # 0.9 of the memory left 3.1 GB for state and pages, short of 64 rows' GDN state, 2026-12-06, so
                 # there it runs 1 / 16 / 64 at 0.98)
             mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
             big=$( [ "$mib" -gt 100000 ] && echo 1 || echo 0 )
             batches=${MOE_BATCHES:-$( [ $big = 1 ] && echo 1,16,64,256 || echo 1,16,64 )}
             CUDA_VISIBLE_DEVICES=0 run moe35 ${MOE_SHARE:-540} python3 bench/moe.py --record \
               --config bench/configs/qwen3.5-35b-a3b.json --batches $batches \
               $( [ $big = 1 ] || echo --gpu-memory-utilization 0.98 ) ${MOE_ARGS:-} ;;   # e.g. --ttft 2048,8192
    moecheck)    # issue 40: the MoE expert kernels against their reference on the GPU, at 35B-A3B shapes (MC_ARGS:
                 # more moe_check.py arguments, e.g. --sweep for the sorted kernels' tiles)
             CUDA_VISIBLE_DEVICES=0 run moecheck ${MC_SHARE:-90} python3 bench/moe_check.py --record \
               --config bench/configs/qwen3.5-35b-a3b.json ${MC_ARGS:-} ;;
    moeprofile)  # issue 40: where the 35B-A3B decode step's time goes at batch MP_BATCH (default 1; per scope and
                 # layer; the trace comes back in moeprofile.tgz)
             XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 CUDA_VISIBLE_DEVICES=0 run moeprofile ${MP_SHARE:-150} \
               python3 bench/profile.py --config bench/configs/qwen3.5-35b-a3b.json --random-weights \
               --batch ${MP_BATCH:-1} --prompt-len ${MP_PROMPT:-64} --decode-steps 4 --greedy --out /tmp/moeprofile \
               --top-unattributed 25 ${MP_KC:+--kernel-config "$MP_KC"}
             tar czf "$out/moeprofile.tgz" -C /tmp moeprofile ;;
    prefillprofile)  # issue 39: where one 8k prompt's prefill goes (9B, batch 1), with PP_KC's --kernel-config if set
             CUDA_VISIBLE_DEVICES=0 run prefillprofile ${PP_SHARE:-120} python3 bench/profile.py \
               --config bench/configs/qwen3.5-9b.json --random-weights --batch 1 --prompt-len ${PP_LEN:-8192} \
               --decode-steps 2 --greedy --out /tmp/prefillprofile --top-unattributed 10 ${PP_KC:+--kernel-config "$PP_KC"} ;;
    lmhead)      # issue 39: the prefill executable's lm_head against the decode step's, and forms of it
             CUDA_VISIBLE_DEVICES=0 run lmhead ${LH_SHARE:-90} python3 bench/lm_head.py --record \
               --config bench/configs/qwen3.5-9b.json --tokens 8192 ;;
    ttftab)      # issue 39: TTFT at TA_LENS with the default KernelConfig and each of TA_VARIANTS (';'-separated
                 # --kernel-config settings; default: XLA's Triton GEMMs off), one engine each, no HF or jnp attention
             IFS=';' read -ra tav <<< "${TA_VARIANTS:-xla_options.xla_gpu_enable_triton_gemm=false}"
             for kc in "" "${tav[@]}"; do
               CUDA_VISIBLE_DEVICES=0 run ttft${kc:+_$(echo $kc | tr -c 'a-z0-9_\n' _)} ${TA_SHARE:-150} python3 bench/long_context.py --record \
                 --config bench/configs/qwen3.5-9b.json --parts ttft --lens ${TA_LENS:-8192,32768} --hf-lens "" \
                 --jnp-max 0 ${kc:+--kernel-config $kc}
             done ;;
    gemv)        # decode projections at batch 1: XLA's GEMM against a Pallas GEMV sweep (an experiment)
             CUDA_VISIBLE_DEVICES=0 run gemv ${GV_SHARE:-150} python3 bench/gemv.py --record ;;
    gemmlayout)  # decode projections by weight layout, [K, N] against [N, K], XLA and GEMV kernels (an experiment)
             CUDA_VISIBLE_DEVICES=0 run gemmlayout ${GL_SHARE:-150} python3 bench/gemm_layout.py --record \
               ${GL_SHAPES:+--shapes $GL_SHAPES} ${GL_ROWS:+--rows $GL_ROWS} ;;
    multiturn) CUDA_VISIBLE_DEVICES=0 run multiturn ${MT_SHARE:-480} python3 bench/multiturn.py --record \
                 --config bench/configs/qwen3.5-9b.json --num-state-snapshots 64 --snapshots ${MT_SNAPSHOTS-16 32} \
                 --rounds 2 --random-requests ${MT_RANDOM:-64} --think-ms ${MT_THINK_MS:-0} \
                 --compilation-cache-dir $xla/multiturn ;;   # prefix cache: 32 conversations x 6 turns, on vs off
    tp27b) run tp27b 300 python3 bench/tp.py --configs bench/configs/qwen3.5-27b.json --tp 2 --batches 1,16 --record ;;
  esac
done
pack
echo "session done after $(( $(date +%s) - start ))s"
