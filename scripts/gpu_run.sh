#!/usr/bin/env bash
# Everything the GPU machine checks, in one call (run from the repo root there):
#   bash scripts/gpu_run.sh [STEP ...]        (default: smoke tests bench)
# Steps:
#   smoke      scripts/gpu_smoke.py: every kernel variant lowers and matches the reference
#   tests      the gpu-marked tests of tests/test_race_kernel.py (the Gumbel kernel at production
#              shapes);  alltests: every gpu, kernels or slow test of tests/
#   main       the README's table (sample suite, B = 1, 32, 128, V = 151936; plain, top-k 50 +
#              top-p 0.9, top-p 0.95, min-p 0.05): main-fp32 and main-bf16, one dtype each
#   bench      the Gumbel kernel: sample suite, all B, fp32/bf16, randn and llm rows, FP64
#              noise, params closed over (a batch without filters compiles the kernel alone)
#   mask       issue 5's table: truncation suite, sample + mask against sample alone
#   SUITE      any other suite of python -m jaxsample.bench (truncation, profile, extract,
#              fp64, spec, sweep, pivot, sort, processing, sharded) with its defaults
#   decode     python -m jaxsample.bench decode $DECODE_ARGS (e.g. "--shapes qwen2.5-0.5b")
#   serve      python -m jaxsample.bench serve: the embedded model (no drafts, n-gram, draft model, synthetic;
#              1 and 8 steps per call, without the host/device overlap) and a
#              Qwen2.5-0.5B-shaped random model
#   multigpu   (2 GPUs) the gpu-marked tests of tests/test_sharding.py and tests/test_vocab_parallel.py,
#              and a 2-process jax.distributed run
#   peers      the gpu-marked tests of tests/test_bench_peers.py and tests/test_flashinfer_peer.py:
#              torch's, vLLM's and FlashInfer's samplers (the copies: .peers/vllm, .peers/flashinfer)
#   report-V-DTYPE, reportspec-V-DTYPE   one slice of python -m jaxsample.bench report (the
#              sample part / the verification part at vocabulary V in DTYPE) into $OUT/STEP/,
#              with vLLM's kernels from $VLLM_SRC (default .peers/vllm) and FlashInfer's from
#              $FLASHINFER_SRC (default .peers/flashinfer) where those folders exist
# $BENCH_ARGS is appended to every benchmark step's command (e.g. "--batch 128 --iters 16").
# Logs and JSON go to $OUT (the device tool's output folder) or ./gpu-out, one STEP.log and
# STEP.json per step.  GPU_TEST_WORKERS: pytest-xdist workers for the tests (default 6; 0: none).
set -uo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,/^set -uo/p' "$0" | grep '^#' | cut -c3-; exit 0; fi
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out="${OUT:-gpu-out}"; mkdir -p "$out"
steps=("$@"); [[ ${#steps[@]} -gt 0 ]] || steps=(smoke tests bench)
steps=($(printf '%s\n' "${steps[@]}" | sed 's/^main$/main-fp32\nmain-bf16/'))
quiet() { grep -v "UserWarning\|warnings.warn"; }
workers="${GPU_TEST_WORKERS:-6}"; xdist=(); [[ "$workers" == 0 ]] || xdist=(-n "$workers")
status=0
bench() {  # bench STEP SUITE [ARGS...]: one suite's table to STEP.log, its rows to STEP.json
  local step="$1"; shift
  # shellcheck disable=SC2086  # BENCH_ARGS is a word list
  python3 -m jaxsample.bench "$@" ${BENCH_ARGS:-} --out "$out/$step.json" 2>&1 | quiet \
    | tee "$out/$step.log"
  status=$((status | ${PIPESTATUS[0]}))
}
for step in "${steps[@]}"; do
  case "$step" in
    smoke) python3 scripts/gpu_smoke.py 2>&1 | quiet | tee "$out/smoke.log" || exit 1 ;;
    tests|alltests)
      files=(tests/test_race_kernel.py); marks=gpu
      [[ "$step" == alltests ]] && files=(tests/) && marks="gpu or kernels or slow"
      python3 -m pytest -m "$marks" -q -rA -p no:cacheprovider "${xdist[@]}" "${files[@]}" \
        2>&1 | quiet > "$out/gpu-$step.log"
      status=$((status | ${PIPESTATUS[0]})); grep -E "^(FAILED|ERROR)" "$out/gpu-$step.log"
      tail -n 3 "$out/gpu-$step.log" ;;
    main-fp32|main-bf16)
      bench "$step" sample --batch 1,32,128 --dtypes "$([[ $step == main-fp32 ]] && echo float32 \
        || echo bfloat16)" --settings plain,top_k50+top_p0.9,top_p0.95,min_p0.05 --params both \
        --iters 16 --repeats 3 ;;
    bench) bench bench sample --dists randn,llm --params static --fp64 --no-reference \
             --iters 32 --repeats 5 ;;
    mask) bench mask truncation --batch 1,32,128,256 --settings top_k50+top_p0.9,top_p0.95 \
            --mask-caps 64,1024,4096 --no-peers --no-reference --iters 16 --repeats 3 ;;
    truncation|profile|extract|fp64|spec|sweep|pivot|sort|processing|sharded) bench "$step" "$step" ;;
    decode)
      # shellcheck disable=SC2086  # DECODE_ARGS is a word list
      python3 -m jaxsample.bench decode ${DECODE_ARGS:-} --json "$out/decode.json" 2>&1 | quiet \
        | tee "$out/decode.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    serve)
      demo=(python3 -m jaxsample.bench serve --requests 128 --slots 32 --max-tokens 64)
      qwen=(--random --vocab 151936 --d-model 896 --layers 24 --heads 14 --kv-heads 2 --mlp 4864
            --dtype bfloat16 --cache-len 1024 --prompt-len 64 --slots 64)
      { "${demo[@]}" --spec none ngram draft synthetic:0.9,0.8,0.7,0.6 \
          && "${demo[@]}" --no-overlap --spec none \
          && "${demo[@]}" --steps-per-call 8 --spec none \
          && "${demo[@]}" "${qwen[@]}" --spec none synthetic:0.9,0.8,0.7,0.6; } 2>&1 | quiet \
        | tee "$out/serve.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    multigpu)
      python3 -m pytest -m gpu -v -rfE -p no:cacheprovider tests/test_sharding.py \
        tests/test_vocab_parallel.py 2>&1 \
        | quiet > "$out/gpu-multigpu.log"
      status=$((status | ${PIPESTATUS[0]})); tail -n 3 "$out/gpu-multigpu.log"
      for i in 0 1; do
        CUDA_VISIBLE_DEVICES=$i JAX_PLATFORMS=cuda python3 scripts/multiprocess_sample.py 12355 2 \
          "$i" "$out/multiprocess.txt" > "$out/multiprocess-$i.log" 2>&1 &
      done
      wait; cat "$out/multiprocess.txt"; grep -q '^True' "$out/multiprocess.txt" || status=1 ;;
    peers)
      python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_bench_peers.py tests/test_flashinfer_peer.py 2>&1 | quiet \
        > "$out/gpu-peers.log"
      status=$((status | ${PIPESTATUS[0]})); tail -n 30 "$out/gpu-peers.log" ;;
    report-*-*|reportspec-*-*)
      IFS=- read -r kind vocab dtype <<< "$step"
      part=--no-spec; [[ "$kind" == reportspec ]] && part=--no-sample
      copies=(); [[ -d "${VLLM_SRC:-.peers/vllm}" ]] && copies=(--vllm-src "${VLLM_SRC:-.peers/vllm}")
      [[ -d "${FLASHINFER_SRC:-.peers/flashinfer}" ]] &&
        copies+=(--flashinfer-src "${FLASHINFER_SRC:-.peers/flashinfer}")
      # shellcheck disable=SC2086  # BENCH_ARGS is a word list
      python3 -m jaxsample.bench report --vocab "$vocab" --dtypes "$dtype" "$part" "${copies[@]}" \
        --no-progress ${BENCH_ARGS:-} --out "$out/$step" 2>&1 | quiet | tee "$out/$step.log"
      status=$((status | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $step (bash scripts/gpu_run.sh --help)" >&2; exit 2 ;;
  esac
done
exit $status
