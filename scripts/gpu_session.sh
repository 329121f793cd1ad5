#!/usr/bin/env bash
# Everything pending on the GPU machine, in one call that fits the 10-minute limit
# (run with the device tool from the repository root; results land in $OUT):
#   bash scripts/gpu_session.sh quick      GPU-only tests + demo checks (also --gpus 0) + bench batch (about 6-7 min)
#   bash scripts/gpu_session.sh residency2k the step-4 residency benchmark at 2,000 rows, both runs (about 5 min)
#   bash scripts/gpu_session.sh residency-blocking  the limited run with --prefetch-gpu-adapters 0 (attribution)
#   bash scripts/gpu_session.sh kernels    the kernel launch-config sweep, then mlora bench kernels
#   bash scripts/gpu_session.sh decode64   bench batch at --max-num-seqs 64 (step 7's decode target at 64 rows)
#   bash scripts/gpu_session.sh profile    decode kernels by GPU time, base and 64 adapters (where 1.7x the floor goes)
#   bash scripts/gpu_session.sh kernels-split  the default config per sweep case, with shrink alone and an empty graph
#   bash scripts/gpu_session.sh residency  the step-4 residency benchmark, limited run (about 8 min)
#   bash scripts/gpu_session.sh split-kv   decode attention with split keys: tests, bench batch at 64 rows, splits 1/2/auto, load breakdown (~6 min)
#   bash scripts/gpu_session.sh residency-ab  the limited run alone, unsampled (A/B of env knobs across calls)
#   bash scripts/gpu_session.sh attention-order  decode attention dispatch orders and equal contexts (~3 min)
#   bash scripts/gpu_session.sh decode-order     bench batch at 64 rows, A/B of MLORA_DECODE_ORDER (ORDER=... picks)
#   bash scripts/gpu_session.sh joint      --memory-ledger joint: its GPU test, the 8,000-row limited run in one arena
#   bash scripts/gpu_session.sh joint-all  split against joint with all-module adapters (64, 16 slots), tokens compared
#   bash scripts/gpu_session.sh gc-batch   bench batch A/B of MLORA_GC=default,device-wait at 64 and 256 running rows
#   bash scripts/gpu_session.sh mixed-order  kernel_sweep.py --mixed (the tile order measured in the twenty-fourth session: no gain, deleted)
#   bash scripts/gpu_session.sh dense-shrink  dense (cuBLAS) and grouped (torch._grouped_mm) LoRA shrinks and pairs against the segmented ones: decode layers, then --grid (bench kernels misses)
#   bash scripts/gpu_session.sh misses       kernel_sweep.py --misses: launch-bound misses under taller row tiles
#   bash scripts/gpu_session.sh drain        256-row job A/B of MLORA_BLAS_ROWS=1:128,off (its drain), --misses, prefill profile
#   bash scripts/gpu_session.sh logits-bf16  logits in the model's dtype: GPU tests, demo x3, 256-row decode against the float32 copy
#   bash scripts/gpu_session.sh chain        chained decode (MLORA_CHAIN_DECODE=1): GPU tests, demo x3, host-wait profile, bench A/B 256 and 64 rows
#   bash scripts/gpu_session.sh chain-ab     chained decode against unchained at 256 rows, 0 and 64 adapters, reversed order, twice
#   bash scripts/gpu_session.sh greedy       the greedy choice in two Triton launches: GPU tests, demo x2, argmax timing
#   bash scripts/gpu_session.sh greedy-ab    the Triton greedy choice against torch.argmax in bench batch (base, 256 and 64 rows)
#   bash scripts/gpu_session.sh sensitivity  the 8B bf16 logits check with its one-rounding sensitivity, then bench batch 0,64
#   bash scripts/gpu_session.sh power        burst ceilings against 3 s of sustained matmul / copy / a 256-row gate/up GEMM, with SM clocks and power
#   bash scripts/gpu_session.sh ceilings     the ceilings five times each way (median of 10, best of 20) with NVML clocks, then bench batch 0,8,64
#   bash scripts/gpu_session.sh compiles     kernel tests, then the Triton compiles of a 64-adapter bench (after do_not_specialize)
#   bash scripts/gpu_session.sh gemm-group   the base GEMMs against other cuBLAS call shapes; kernel_sweep.py --mixed
#   bash scripts/gpu_session.sh gemm-ab      the GEMM probe again, then cuBLASLt against cuBLAS at 64 running rows (bench A/B)
#   bash scripts/gpu_session.sh blas         cuBLASLt for small forwards (default): GPU tests, demo x3, 8B logits, 256-row A/B
#   bash scripts/gpu_session.sh resident   the step-4 residency benchmark, all-resident run (about 6 min)
#   bash scripts/gpu_session.sh lookahead  batch-run --lookahead: GPU tests, demo check, bench batch 0,8 and a decode profile
#   bash scripts/gpu_session.sh logits     bf16 logits error of mlora and of transformers over the same 8B-shaped weights
#   bash scripts/gpu_session.sh step7      bf16-vs-fp32 logits of the 8B shape, then start-up (checkpoint to GPU, first token)
#   bash scripts/gpu_session.sh peft       the transformers + PEFT baseline (step 7), 8 and 64 adapters
#   bash scripts/gpu_session.sh compress   the step-5 compression benchmark: 1,000 Mistral-7B q/k/v adapters, R 64, 8 clusters
#   bash scripts/gpu_session.sh bundle-data  then  bundle   the step-5 serving benchmark (two calls back to back;
#                                            bundle-data runs the bundle GPU tests, bundle all four runs incl. the Triton operator)
#   bash scripts/gpu_session.sh bundle-triton  the bundle through the Triton operator against the torch one alone
#   bash scripts/gpu_session.sh tune         decode attention launch sweep, Triton compiles inside bench batch, compress profile
#   bash scripts/gpu_session.sh prefill      Triton compiles of a bench run after the alignment fix
#   bash scripts/gpu_session.sh fused        GPU kernel tests on both LoRA paths, then the fused-launch calibration sweep
#   bash scripts/gpu_session.sh kv-layout    page-major against layer-major KV (the one-arena ledger's first step): tests, demo, bench batch A/B
#   bash scripts/gpu_session.sh attention-warps  paged attention at 4 and 8 warps: GPU attention tests, demo, bench batch
#   bash scripts/gpu_session.sh decode-lora  the expand with vectorised B loads: kernel tests, kernel_sweep.py --decode (the expand and shrink knobs), bench batch 0,8,64 (~8 min)
#   bash scripts/gpu_session.sh pitched      rank-pitched B banks (sixteenth session, built on the CPU): GPU tests, demo bf16,
#                                            kernel_sweep.py --mixed (rank_pitched vs padded), --decode --split,
#                                            base decode at 64 rows (RoPE + KV write) (~6 min)
#   bash scripts/gpu_session.sh pitched-bench  then: bench kernels, bench batch 0,8,64 (~8 min)
#   bash scripts/gpu_session.sh latency      GPU slice tests, a decode launch pair's fixed cost (scripts/lora_latency.py),
#                                            kernel_sweep.py --decode, the bench kernels grid (~4 min)
#   bash scripts/gpu_session.sh prefill-lora  the LoRA launches of an 8,192-token prefill chunk under the expand's knobs
#                                            (kernel_sweep.py --prefill), then a prefill iteration's kernels by GPU time (~7 min)
#   bash scripts/gpu_session.sh prefill-bench  after a launch_config change found by prefill-lora: the bench kernels
#                                            grid, then bench batch 0,8,64 (~9 min)
#   bash scripts/gpu_session.sh prefill-ab    bench batch 8,64 with 64- and 128-wide expand column tiles at 32-row tiles (~5 min)
#   bash scripts/gpu_session.sh prefill-attn-bench  the adopted prefill attention tile: GPU attention tests, demo fp32/bf16,
#                                            bench batch 0,8,64 (~7 min)
#   bash scripts/gpu_session.sh split-rule   decode sweeps with a floor on the K-blocks per shrink program (min_k_blocks)
#   bash scripts/gpu_session.sh probe-busy   cold loads beside a decode-like graph, per launch of the validation kernel
#   bash scripts/gpu_session.sh probe-job    prepared per-slot probes against per-load ones: idle and busy-GPU loads, A/B
#   bash scripts/gpu_session.sh split-rule-bench  with a rule it found made the default: kernel tests, demo, grid, bench batch 8,64
#   bash scripts/gpu_session.sh ncu-lora     Nsight Compute counters of one decode layer's LoRA launches, 64 and 8 adapters
#   bash scripts/gpu_session.sh silu-fused  the gate/up expand fused into the SiLU product: GPU tests, demo bf16/fp32,
#                                            bench batch 8,64 with MLORA_LORA_SILU_FUSED=0 and =1 (~8 min)
#   bash scripts/gpu_session.sh silu-sweep  the fused gate/up SiLU product against the plain path at decode and prefill
#                                            sizes with 1-8 column tiles per program (kernel_sweep.py --silu), then
#                                            first the demo and a base decode profile (the residual add fold) (~5 min)
#   bash scripts/gpu_session.sh silu-ab     then: bench batch --ab MLORA_LORA_SILU_MIN_ROWS=1024,0 at 64 adapters, twice (~5 min)
#   bash scripts/gpu_session.sh prefill-attn  the prefill attention launch with 64/128/256-row tiles x BLOCK_N x warps x
#                                            stages (attention_sweep.py --prefill --quick), against its flop floor (~5 min)
#   bash scripts/gpu_session.sh overlap      LoRA shrinks on a side stream beside the base GEMMs (MLORA_LORA_OVERLAP=1): tests, demo, bench batch A/B (~7 min)
# Each part writes JSON/text under $OUT; copy the figures into BENCHMARKS.md.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"

# The demo job on the GPU checked against expected.json: demo_gpu LABEL DTYPE [batch-run options...];
# environment assignments before the call (MLORA_X=1 demo_gpu ...) apply to the job
demo_gpu() {
  local label=$1 dt=$2
  shift 2
  rm -rf "/tmp/demo-$label"
  timeout 90 python -m mlora batch-run examples/demo/prompts.parquet "/tmp/demo-$label" --base examples/demo/base \
    --adapters examples/demo/adapters --max-new-tokens 40 --device cuda --dtype "$dt" -q "$@" >/dev/null
  echo "demo $label ($dt): $(python scripts/check_demo_outputs.py "/tmp/demo-$label" | tail -1)"
}

case "${1:-quick}" in
  quick)
    timeout 300 python -m pytest -q tests/test_batch_graphs.py tests/test_batch_attention.py tests/test_batch_model.py \
      tests/test_residency.py tests/test_residency_validate.py tests/test_kernels_triton.py tests/test_kernels_slices.py \
      tests/test_batch_fused.py tests/test_bundle_serving.py tests/test_batch_lookahead.py tests/test_residency_pinned.py \
      tests/test_kernels_fused.py tests/test_bundle_triton.py \
      tests/test_batch_bench.py::test_recording_engine_records_chained_iterations_too 2>&1 | tail -15
    for dt in float32 bfloat16; do
      rm -rf "/tmp/demo-$dt"
      timeout 90 python -m mlora batch-run examples/demo/prompts.parquet "/tmp/demo-$dt" --base examples/demo/base \
        --adapters examples/demo/adapters --max-new-tokens 40 --device cuda --dtype "$dt" -q >/dev/null 2>"$OUT/demo-$dt.err"
      echo "demo $dt: $(python scripts/check_demo_outputs.py "/tmp/demo-$dt" | tail -1)"
    done
    MLORA_DEBUG_GRAPHS=1 demo_gpu debug-graphs bfloat16  # every replay's static buffers checked (twenty-third session)
    rm -rf /tmp/demo-gpus0  # step 8's coordinator and one GPU worker process (never run on a GPU before)
    timeout 120 python -m mlora batch-run examples/demo/prompts.parquet /tmp/demo-gpus0 --base examples/demo/base \
      --adapters examples/demo/adapters --max-new-tokens 40 --gpus 0 --dtype float32 -q >/dev/null 2>"$OUT/demo-gpus0.err"
    echo "demo --gpus 0: $(python scripts/check_demo_outputs.py /tmp/demo-gpus0 | tail -1)"
    # through compile_log: every Triton compile with its time, so compiles inside timed runs show (twelfth session)
    timeout 300 python -u scripts/compile_log.py bench batch --rows 1024 --adapters 0,8,64 --out "$OUT/batch-h200.json" \
      > "$OUT/batch-compiles.txt" 2>&1; grep -E "adapters:|compiles$|^ +[0-9]+  " "$OUT/batch-compiles.txt"
    timeout 120 python scripts/profile_batch.py --rows 256 --adapters 8 --graphs --iters 10 2>&1 | grep -v USDT | head -8
    ;;
  lookahead)  # batch-run --lookahead on the GPU: graph tests, the demo check, then the batch bench A/B part
    timeout 150 python -m pytest -q tests/test_batch_lookahead.py tests/test_batch_graphs.py 2>&1 | tail -3
    for dt in float32 bfloat16; do
      demo_gpu "lookahead-$dt" "$dt" --lookahead
    done
    timeout 240 python -m mlora bench batch --rows 1024 --adapters 0,8 --lookahead --out "$OUT/batch-lookahead.json" 2>&1 \
      | grep adapters
    timeout 100 python scripts/profile_batch.py --rows 256 --adapters 8 --graphs --lookahead --iters 10 2>&1 | grep -v USDT | head -8
    ;;
  attention-warps)  # paged attention spills at 4 warps on sm_90 (compile_kernels.py); A/B with 8 (about 4 min)
    timeout 100 python -m pytest -q tests/test_batch_attention.py 2>&1 | tail -1  # incl. both warp counts
    for w in 4 8; do
      run="import sys, mlora.kernels.paged_attention as pa; pa.DECODE_WARPS = pa.PREFILL_WARPS = $w; from mlora.cli.app import app; app()"
      rm -rf "/tmp/demo-w$w"
      timeout 90 python -c "$run" batch-run examples/demo/prompts.parquet "/tmp/demo-w$w" --base examples/demo/base \
        --adapters examples/demo/adapters --max-new-tokens 40 --device cuda --dtype bfloat16 -q >/dev/null
      echo "warps $w demo bf16: $(python scripts/check_demo_outputs.py "/tmp/demo-w$w" | tail -1)"
      timeout 150 python -c "$run" bench batch --rows 1024 --adapters 0,8 --out "$OUT/batch-warps$w.json" 2>&1 | grep adapters
    done
    ;;
  logits)  # bf16 logits error of mlora against transformers' over the same weights, 8B shape (then the check itself)
    timeout 330 python scripts/logits_vs_hf.py --preset-8b --seqs 2 --tokens 512 2>&1 | grep layers
    ;;
  step7)
    timeout 200 python scripts/logits_check.py 2>&1 | tail -2
    timeout 360 python -m mlora bench startup /tmp/su --out "$OUT/startup-h200.json" 2>&1 | tail -3
    ;;
  peft)  # the transformers + PEFT baseline of step 7 (fewer rows: it is slow), 8 and 64 adapters
    for n in ${2:-8 64}; do  # e.g. `bash scripts/gpu_session.sh peft 64`
      # 64 adapters: 117 s to build, then ~44 tok/s x 16,384 tokens (tenth session): ~490 s, one call per count
      timeout $([ "$n" = 64 ] && echo 570 || echo 280) python -m mlora bench peft --rows 128 --adapters $n --batch-size 0 \
        --json --out "$OUT/peft-$n.json" \
        2>"$OUT/peft-$n.err" | tail -1; tail -1 "$OUT/peft-$n.err"  # per-batch progress: a timed-out run keeps its rate
    done
    ;;
  residency2k)  # the 2,000-row job of the fourth and fifth sessions' runs (BENCHMARKS.md, residency)
    rm -rf /tmp/bb  # the bundle workspace (35 GB) would not fit beside this one (30 GB)
    timeout 560 python -m mlora bench residency /tmp/rb --adapters 1000 --rows 2000 --slots 64 \
      --runs limited,all-resident --out "$OUT/residency-2k.json" 2>&1 | tail -12
    ;;
  residency-blocking)  # the same limited run with loads blocking (attribution of the asynchronous loads)
    rm -rf /tmp/bb  # the bundle workspace (35 GB) would not fit beside this one (30 GB)
    timeout 560 python -m mlora bench residency /tmp/rb --adapters 1000 --rows 2000 --slots 64 --runs limited \
      --prefetch-gpu-adapters 0 --out "$OUT/residency-2k-blocking.json" 2>&1 | tail -8
    ;;
  decode64)  # step 7's decode target at 64 running rows (the bench's default is 256), base and 64 adapters (~3 min)
    timeout 280 python -m mlora bench batch --rows 512 --adapters 0,64 --max-num-seqs 64 --out "$OUT/batch-64seqs.json" \
      2>&1 | grep adapters
    ;;
  split-kv)  # flash-decoding for decode launches of few programs (64 rows: 512 programs on 132 SMs), A/B (~5 min)
    timeout 100 python -m pytest -q tests/test_batch_attention.py tests/test_batch_graphs.py 2>&1 | tail -1
    demo_gpu split-auto float32  # decode key splits automatic
    for n in 1 2 auto; do
      echo "decode splits $n:"
      MLORA_DECODE_SPLITS=$([ $n = auto ] && echo "" || echo $n) timeout 150 python -m mlora bench batch --rows 512 \
        --adapters 0 --max-num-seqs 64 --out "$OUT/batch-64seqs-splits-$n.json" 2>&1 | grep adapters
    done
    timeout 100 python scripts/profile_batch.py --rows 64 --adapters 0 --graphs --iters 10 2>&1 | grep -v USDT \
      | head -24 | tee "$OUT/profile-decode-64rows.txt"
    timeout 60 python scripts/load_breakdown.py --loads 48 2>&1 | tail -9  # issue 5: cold load by stage, idle GPU
    ;;
  tune)  # twelfth session: where the decode attention, the first scenario's prefill and compress time go (~7 min)
    timeout 260 python scripts/attention_sweep.py --quick --rows 64,256 2>&1 | tee "$OUT/attention-sweep.txt" | tail -40
    timeout 200 python -u scripts/compile_log.py bench batch --rows 512 --adapters 0,8 --out "$OUT/batch-compiles.json" \
      > "$OUT/compile-log.txt" 2>&1; grep -E "adapters:|compiles|^ +[0-9]+ " "$OUT/compile-log.txt" | head -30
    grep -c "^\[compile" "$OUT/compile-log.txt"
    timeout 100 python scripts/compress_profile.py 1024 4096 4096 64 8 --device cuda 2>&1 | tail -14
    ;;
  prefill)  # whether bench batch still compiles inside timed runs (the attention sweep: prefill-attn) (~4 min)
    timeout 200 python -u scripts/compile_log.py bench batch --rows 512 --adapters 0,8 --out "$OUT/batch-compiles.json" \
      > "$OUT/compile-log.txt" 2>&1; grep -E "adapters:|compiles|^ +[0-9]+ " "$OUT/compile-log.txt" | head -30
    ;;
  fused)  # the fused single-launch LoRA kernel (twelfth session, off by default): correctness, then its calibration
    timeout 200 python -m pytest -q tests/test_kernels_fused.py tests/test_kernels_slices.py tests/test_kernels_triton.py \
      tests/test_kernels_spec.py 2>&1 | tail -3
    timeout 360 python scripts/kernel_sweep.py --fused 2>&1 | tail -60 | tee "$OUT/kernel-sweep-fused.txt"
    ;;
  decode-lora)  # fourteenth session: the expand's B loads vectorised (CPU finding); one decoder layer's LoRA
    # launches at decode size with the expand knobs, then the engine at 0/8/64 adapters (~8 min)
    timeout 150 python -m pytest -q tests/test_kernels_triton.py tests/test_kernels_slices.py tests/test_kernels_spec.py \
      tests/test_bundle_triton.py 2>&1 | tail -2
    timeout 200 python scripts/kernel_sweep.py --decode 2>&1 | tail -12 | tee "$OUT/kernel-sweep-decode.txt"
    timeout 260 python -m mlora bench batch --rows 1024 --adapters 0,8,64 --out "$OUT/batch-h200.json" 2>&1 | grep adapters
    ;;
  pitched)  # sixteenth session: the engine's B banks rank-pitched (mlora.kernels.pitch); issue step 2's mixed-rank target
    timeout 200 python -m pytest -q tests/test_kernels_pitch.py tests/test_kernels_slices.py tests/test_batch_catalog.py \
      tests/test_residency.py tests/test_batch_graphs.py tests/test_batch_fused.py 2>&1 | tail -2
    demo_gpu pitched bfloat16  # ranks 8 and 16 in a rank-16 bank
    timeout 120 python -u scripts/kernel_sweep.py --mixed 2>&1 | tee "$OUT/kernel-sweep-mixed.txt" | tail -16
    # the decode layer's fixed cost per launch pair: shrinks alone and the empty graph (issue step 7's 64-adapter gap)
    timeout 100 python -u scripts/kernel_sweep.py --decode --split 2>&1 | grep -v Warn | tee "$OUT/kernel-sweep-decode-split.txt" | tail -2
    # the KV-cache write folded into RoPE (sixteenth session): base decode at 64 rows (7.24 ms before)
    timeout 120 python -m mlora bench batch --rows 512 --adapters 0 --max-num-seqs 64 --no-repeat-base \
      --out "$OUT/batch-64seqs.json" 2>&1 | grep adapters
    ;;
  pitched-bench)  # after `pitched`: the whole bench kernels grid, then bench batch 0/8/64 on the pitched banks (~8 min)
    timeout 260 python -m mlora bench kernels --json > "$OUT/kernels-h200.json" 2>"$OUT/kernels.err"; tail -3 "$OUT/kernels.err"
    timeout 300 python -m mlora bench batch --rows 1024 --adapters 0,8,64 --out "$OUT/batch-h200.json" 2>&1 | grep adapters
    ;;
  latency)  # seventeenth session: where a decode launch pair's ~10 us go; the decode sweep; the bench kernels grid
    timeout 100 python -m pytest -q tests/test_kernels_slices.py tests/test_kernels_triton.py 2>&1 | tail -1
    timeout 90 python -u scripts/lora_latency.py 2>&1 | grep -v -i warn | grep -v capture_end | tee "$OUT/lora-latency.txt"
    timeout 100 python -u scripts/kernel_sweep.py --decode 2>&1 | grep -v -i warn | grep -v capture_end \
      | tee "$OUT/kernel-sweep-decode.txt" | grep "^decode"
    timeout 270 python -m mlora bench kernels --json > "$OUT/kernels-h200.json" 2>"$OUT/kernels.err"; tail -3 "$OUT/kernels.err"
    ;;
  prefill-lora)  # eighteenth session: the expand at prefill size (a y read-modify-write at ~2x its byte floor)
    timeout 100 python -m pytest -q tests/test_kernels_slices.py -k "column_groups" 2>&1 | tail -1
    timeout 330 python -u scripts/kernel_sweep.py --prefill 2>&1 | grep -v -i warn | grep -v capture_end \
      | tee "$OUT/kernel-sweep-prefill.txt" | grep "^prefill"
    timeout 150 python scripts/profile_batch.py --rows 256 --adapters 8 --phase prefill --iters 3 2>&1 | grep -v USDT \
      | head -40 | tee "$OUT/profile-prefill-8.txt"
    ;;
  prefill-bench)  # eighteenth session: 128-wide expand column tiles for 32-row tiles at rank <= 16
    timeout 230 python -m mlora bench kernels --json > "$OUT/kernels-h200.json" 2>"$OUT/kernels.err"; tail -3 "$OUT/kernels.err"
    timeout 330 python -m mlora bench batch --rows 1024 --adapters 0,8,64 --no-repeat-base --out "$OUT/batch-h200.json" \
      2>&1 | grep adapters
    ;;
  prefill-ab)  # the engine's prefill with 64- and 128-wide expand column tiles for 32-row tiles (same machine)
    for bn in 64 128; do
      run="import mlora.kernels.triton_sgmv as s; s._expand_block_n = lambda bm, R: ($bn if bm >= 32 else 64) if R <= 16 else (64 if bm >= 32 else 128); from mlora.cli.app import app; app()"
      echo "32-row tiles, rank <= 16: block_n $bn"
      timeout 140 python -c "$run" bench batch --rows 1024 --adapters 8,64 --no-repeat-base --out "$OUT/batch-bn$bn.json" \
        2>&1 | grep adapters
    done
    ;;
  silu-fused)  # eighteenth session: lora_silu_mul (triton_act) in the engine, correctness then A/B on one machine
    timeout 120 python -m pytest -q tests/test_kernels_act.py tests/test_batch_graphs.py tests/test_batch_catalog.py \
      -k "act or silu or graph or gate_up" 2>&1 | tail -1
    for dt in float32 bfloat16; do
      demo_gpu "fused-silu-$dt" "$dt"
    done
    for f in 0 1; do
      echo "MLORA_LORA_SILU_FUSED=$f:"
      MLORA_LORA_SILU_FUSED=$f timeout 140 python -m mlora bench batch --rows 1024 --adapters 8,64 --no-repeat-base \
        --out "$OUT/batch-silu$f.json" 2>&1 | grep adapters
    done
    ;;
  silu-sweep)  # eighteenth session: whether column groups make the fused launch pay at decode too; first the
    # demo on the GPU (the MLP residual add folded into the next layer's input norm, built on the CPU; and the
    # demo with the fused SiLU product in every invocation, graphs included)
    timeout 120 python -m pytest -q tests/test_batch_run.py -k "fused_everywhere" 2>&1 | tail -1
    for dt in float32 bfloat16; do
      demo_gpu "fold-$dt" "$dt"
    done
    timeout 90 python scripts/profile_batch.py --rows 256 --adapters 0 --graphs --iters 10 2>&1 | grep -v USDT | head -24 \
      | tee "$OUT/profile-decode-0.txt"
    timeout 150 python -u scripts/kernel_sweep.py --silu 2>&1 | grep -v -i warn | grep -v capture_end \
      | tee "$OUT/kernel-sweep-silu.txt"
    ;;
  silu-ab)  # after silu-sweep: the fusion at decode too (threshold 0) against large invocations only (1024),
    # 8 and 64 adapters, interleaved twice (~8 min; nineteenth session: 4 column tiles per program)
    timeout 560 python -m mlora bench batch --rows 1024 --adapters 8,64 --ab MLORA_LORA_SILU_MIN_ROWS=1024,0 \
      --ab-repeats 2 --out "$OUT/batch-silu-ab.json" 2>&1 | grep -E "adapters|MLORA|^[│|]"
    ;;
  prefill-attn)  # eighteenth session: prefill attention took ~12 ms of a ~200 ms 8,192-token chunk (several x its flops)
    timeout 500 python -u scripts/attention_sweep.py --prefill --quick 2>&1 | grep -v -i warn \
      | tee "$OUT/attention-sweep-prefill.txt" | tail -30
    ;;
  prefill-attn-bench)  # nineteenth session: the prefill tile prefill-attn found (128 rows, 32 keys, 8 warps, 2 stages):
    # GPU attention tests, the demo in float32 and bfloat16, then bench batch 0,8,64 (~7 min)
    timeout 100 python -m pytest -q tests/test_batch_attention.py tests/test_batch_graphs.py 2>&1 | tail -1
    for dt in float32 bfloat16; do
      demo_gpu "prefill-tile-$dt" "$dt"
    done
    timeout 330 python -m mlora bench batch --rows 1024 --adapters 0,8,64 --out "$OUT/batch-h200.json" 2>&1 | grep adapters
    ;;
  ncu-lora)  # nineteenth session: Nsight Compute counters of one decode layer's LoRA launches (256 rows, rank 16),
    # 64 adapters then 8 (scripts/ncu_decode_lora.py: the second round of each; ~4 min)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    for spec in 64:16 8:40; do
      A=${spec%%:*}; skip=${spec##*:}
      PYTHONPATH=. timeout 240 "$NCU" --clock-control none --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --section SourceCounters -k regex:"_shrink_kernel|_expand_kernel" --launch-skip "$skip" --launch-count 8 \
        -o "$OUT/lora-$A" python scripts/ncu_decode_lora.py > "$OUT/ncu-run-$A.txt" 2>&1; tail -3 "$OUT/ncu-run-$A.txt"
      "$NCU" -i "$OUT/lora-$A.ncu-rep" --page details > "$OUT/ncu-details-$A.txt" 2>&1
      "$NCU" -i "$OUT/lora-$A.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,\
smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_membar \
        > "$OUT/ncu-raw-$A.csv" 2>&1
      grep -E "_kernel|Duration|DRAM Throughput|Memory Throughput" "$OUT/ncu-details-$A.txt" | head -40
    done
    ;;
  split-rule)  # nineteenth session (built, not measured): a floor on the K-blocks each split-K shrink program walks
    # (launch_config min_k_blocks) with more programs per SM, at decode size: whole layers, then the shrinks alone (~2 min)
    PYTHONPATH=. timeout 150 python -u scripts/kernel_sweep.py --decode 2>&1 | grep -v -i warn | grep -v capture_end \
      | tee "$OUT/kernel-sweep-decode-split-rule.txt" | grep -E "decode layer|WRONG"
    PYTHONPATH=. timeout 120 python -u scripts/kernel_sweep.py --decode --shrink 2>&1 | grep "decode layer" \
      | tee "$OUT/kernel-sweep-decode-shrink-split-rule.txt"
    ;;
  split-rule-bench)  # twentieth session: run with a split rule made the default in launch_config (measured: 4 programs
    # per SM, at least 8 K-blocks each; not adopted): GPU kernel tests, the demo in bfloat16, the grid, bench batch 8,64 (~9 min)
    timeout 100 python -m pytest -q tests/test_kernels_slices.py tests/test_kernels_fused.py 2>&1 | tail -1
    demo_gpu split-rule bfloat16
    timeout 230 python -m mlora bench kernels --json > "$OUT/kernels-h200.json" 2>"$OUT/kernels.err"; tail -3 "$OUT/kernels.err"
    timeout 250 python -m mlora bench batch --rows 1024 --adapters 8,64 --out "$OUT/batch-h200.json" 2>&1 | grep adapters
    ;;
  probe-busy)  # twentieth session: a load's validation kernel waiting for SMs behind a running job (issue 5's cold
    # load): residency validation tests, one load on an idle GPU, then loads beside a decode-like graph per launch of
    # the word-stats kernel (programs x blocks per step) (~3 min)
    [ -n "${SKIP_TESTS:-}" ] || timeout 120 python -m pytest -q tests/test_residency_validate.py tests/test_residency.py \
      2>&1 | tail -1
    timeout 60 python scripts/load_breakdown.py --loads 48 --probe-variants default,p32u4 2>&1 \
      | grep -E "^probe|copy stream|ensure"
    timeout 300 python scripts/load_breakdown.py --loads 128 --busy-gpu \
      --probe-variants default,u4,p132,p64u4,p32u4,p16u4,default 2>&1 | tee "$OUT/load-breakdown-busy.txt" \
      | grep -E "busy GPU|^probe|copy stream|ensure"
    ;;
  probe-job)  # twentieth session: prepared per-slot probes (storage.SlotProber) against probes issued per load as before
    # ("plain"), alternated on one machine: loads on an idle GPU, then beside a decode-like graph (~2 min); the
    # 8,000-row job is `residency`
    timeout 60 python -m pytest -q tests/test_residency_validate.py 2>&1 | tail -1
    timeout 60 python scripts/load_breakdown.py --loads 48 --probe-variants plain,default,plain,default 2>&1 \
      | grep -E "^probe|copy stream|ensure|enqueue|issue"
    timeout 150 python scripts/load_breakdown.py --loads 128 --busy-gpu --probe-variants plain,default,plain,default \
      2>&1 | tee "$OUT/load-breakdown-busy.txt" | grep -E "busy GPU|^probe|copy stream|ensure|enqueue|issue"
    ;;
  overlap)  # thirteenth session: shrink ahead on a side stream (opt-in), correctness on the GPU then A/B at 8 and 64 adapters
    MLORA_LORA_OVERLAP=1 timeout 200 python -m pytest -q tests/test_kernels_slices.py tests/test_batch_graphs.py \
      tests/test_batch_catalog.py -k "ahead or graph" 2>&1 | tail -2
    MLORA_LORA_OVERLAP=1 demo_gpu overlap bfloat16
    for ov in 0 1; do
      echo "MLORA_LORA_OVERLAP=$ov:"
      MLORA_LORA_OVERLAP=$ov timeout 170 python -m mlora bench batch --rows 1024 --adapters 8,64 --out "$OUT/batch-overlap$ov.json" \
        2>&1 | grep adapters
    done
    ;;
  kv-layout)  # MLORA_KV_LAYOUT=page-major (docs/sizing.md's arena, step one) against the default, base only (~6 min)
    MLORA_KV_LAYOUT=page-major timeout 100 python -m pytest -q tests/test_batch_attention.py tests/test_batch_graphs.py 2>&1 | tail -1
    MLORA_KV_LAYOUT=page-major demo_gpu page-major bfloat16
    for lay in layer-major page-major; do
      echo "$lay:"
      MLORA_KV_LAYOUT=$lay timeout 120 python -m mlora bench batch --rows 512 --adapters 0 --max-num-seqs 64 \
        --no-repeat-base --out "$OUT/batch-64seqs-$lay.json" 2>&1 | grep adapters
      MLORA_KV_LAYOUT=$lay timeout 150 python -m mlora bench batch --rows 1024 --adapters 0 --no-repeat-base \
        --out "$OUT/batch-$lay.json" 2>&1 | grep adapters
    done
    ;;
  profile)  # the decode iteration's GPU kernels by total time, base and 64 adapters (step 7's gap, ~3 min)
    for n in 0 64; do
      timeout 130 python scripts/profile_batch.py --rows 256 --adapters $n --graphs --iters 10 2>&1 | grep -v USDT \
        | head -40 | tee "$OUT/profile-decode-$n.txt"
    done
    ;;
  kernels-split)  # where each sweep case's time goes: shrink alone, neither launch (about 2 min)
    timeout 200 python scripts/kernel_sweep.py --split 2>&1 | tail -25 | tee "$OUT/kernel-split.txt"
    ;;
  kernels)
    timeout 330 python scripts/kernel_sweep.py 2>&1 | tail -40 | tee "$OUT/kernel-sweep.txt"
    timeout 240 python -m mlora bench kernels --json > "$OUT/kernels-h200.json" 2>"$OUT/kernels.err"; tail -3 "$OUT/kernels.err"
    ;;
  residency)
    rm -rf /tmp/bb  # the bundle workspace (35 GB) would not fit beside this one (30 GB)
    timeout 120 python -m pytest -q tests/test_residency_pinned.py tests/test_residency.py tests/test_residency_validate.py \
      2>&1 | tail -2
    timeout 60 python scripts/load_breakdown.py --loads 48 2>&1 | tail -7  # one cold load on an idle GPU, by stage
    # sampled: a run stopped by the time limit still leaves where the engine's time went (seventh session)
    timeout 560 python scripts/sample_engine.py --out "$OUT/prof-limited.txt" -- bench residency /tmp/rb --adapters 1000 \
      --rows 8000 --slots 64 --runs limited --out "$OUT/residency-limited.json" 2>&1 | tail -12
    cp "$OUT/residency-limited.json" /tmp/residency-limited.json 2>/dev/null  # for `resident`'s --compare
    ;;
  residency-ab)  # twenty-first session: the 8,000-row limited run alone, no sampler (its thread takes the
    # interpreter lock every 5 ms), for A/B of environment knobs in calls back to back on one machine
    # (e.g. MLORA_SWITCH_INTERVAL_US=50 bash scripts/gpu_session.sh residency-ab); GPU validation tests first
    rm -rf /tmp/bb
    timeout 60 python -m pytest -q tests/test_residency_validate.py tests/test_residency_pinned.py 2>&1 | tail -1
    echo "MLORA_SWITCH_INTERVAL_US=${MLORA_SWITCH_INTERVAL_US:-default} MLORA_GC=${MLORA_GC:-default}"
    timeout 540 python -m mlora bench residency /tmp/rb --adapters 1000 --rows 8000 --slots 64 --runs limited \
      --out "$OUT/residency-limited.json" 2>&1 | grep -E "^limited|floor|Error|error"
    ;;
  attention-order)  # twenty-first session: decode attention at 64 and 256 rows in four dispatch orders and with
    # equal contexts (is its 1.41x floor at 64 rows load imbalance?); the GPU attention tests first, and the
    # decode graphs' tests with tiles longest first and a heads-first grid (~3 min)
    timeout 120 python -m pytest -q tests/test_batch_attention.py 2>&1 | tail -1
    MLORA_DECODE_ORDER=longest-heads timeout 150 python -m pytest -q tests/test_batch_graphs.py 2>&1 | tail -1
    timeout 200 python scripts/attention_sweep.py --order --rows 64,256 2>&1 | tee "$OUT/attention-order.txt"
    ;;
  decode-order)  # after attention-order: bench batch at 64 running rows, base only, A/B of the decode order
    # (MLORA_DECODE_ORDER=batch against the best order the sweep found, default longest-heads; ~4 min)
    timeout 500 python -m mlora bench batch --rows 512 --adapters 0 --max-num-seqs 64 \
      --ab "MLORA_DECODE_ORDER=batch,${ORDER:-longest-heads}" --ab-repeats 2 --out "$OUT/batch-64seqs-order.json" \
      2>&1 | grep -E "adapters|ab"
    ;;
  joint)  # twenty-first session: --memory-ledger joint (KV and slots from one arena; built and tested on the CPU):
    # its GPU test (the demo with CUDA graphs, the scratch block on the arena's spare page), then the issue's
    # 8,000-row limited run in one arena (~6 min with the workspace written)
    rm -rf /tmp/bb
    timeout 150 python -m pytest -q tests/test_batch_run.py -k "one_arena" 2>&1 | tail -1
    timeout 430 python -m mlora bench residency /tmp/rb --adapters 1000 --rows 8000 --slots 64 --runs limited \
      --memory-ledger joint --out "$OUT/residency-limited-joint.json" 2>&1 | grep -E -A2 "^limited|floor|cold load|Error"
    ;;
  mixed-order)  # issue step 2's mixed-rank target (0.63-0.64 against 0.6 on the factor-bound cases):
    # kernel_sweep.py --mixed (~2 min). Measured in the twenty-fourth session with the tiles dispatched
    # heaviest rank first: no gain (within noise), so the ordering was deleted (BENCHMARKS.md)
    timeout 300 python -u scripts/kernel_sweep.py --mixed 2>&1 | tee "$OUT/kernel-sweep-mixed-order.txt" | tail -22
    ;;
  dense-shrink)  # twenty-third session (built on the CPU): issue step 7's 64-adapter gap is the decode LoRA
    # launches' dependent chains (nineteenth session); is a dense batched GEMM over every slot of the layer's
    # bank cheaper than the segmented shrink at 256 / 64 rows and 8 / 64 adapters? (~3 min)
    timeout 300 python -u scripts/dense_shrink_probe.py 2>&1 | tee "$OUT/dense-shrink.txt" | tail -6
    timeout 200 python -u scripts/dense_shrink_probe.py --grid 2>&1 | tee "$OUT/dense-shrink-grid.txt" | tail -4
    ;;
  misses)  # twenty-fourth session (built on the CPU): issue step 2's launch-bound misses (14 of the 15 sampled are
    # one adapter at T 256 / 1024, where each 16-row tile rereads the slot's A) under taller row tiles (~2 min)
    timeout 300 python -u scripts/kernel_sweep.py --misses 2>&1 | tee "$OUT/kernel-sweep-misses.txt" | tail -17
    ;;
  drain)  # twenty-fifth session: the 256-row job's drain under cuBLASLt up to 128 rows (A/B), the launch-bound misses
    # under taller row tiles, and bank.context per prefill iteration after serial_on_host (~8 min)
    timeout 330 python -m mlora bench batch --rows 1024 --adapters 0,64 --ab MLORA_BLAS_ROWS=1:128,off \
      --out "$OUT/batch-blas-drain.json" 2>&1 | grep -E "adapters|MLORA"
    timeout 200 python -u scripts/kernel_sweep.py --misses 2>&1 | tee "$OUT/kernel-sweep-misses.txt" | tail -17
    timeout 120 python scripts/profile_batch.py --phase prefill --rows 256 --adapters 8 --iters 3 2>&1 \
      | grep -v USDT | tee "$OUT/profile-prefill.txt" | head -8
    ;;
  logits-bf16)  # twenty-fifth session: the forward's logits in the model's dtype (no float32 copy): GPU tests,
    # demo x3, then base decode at 256 rows against the same code with the copy put back (forward(...).float()),
    # two processes each, alternating (~8 min)
    timeout 200 python -m pytest -q tests/test_batch_model.py tests/test_batch_graphs.py tests/test_batch_sampling.py \
      tests/test_batch_lookahead.py 2>&1 | tail -2
    for dt in float32 bfloat16; do demo_gpu "logits-$dt" "$dt"; done
    MLORA_DEBUG_GRAPHS=1 demo_gpu logits-debug-graphs bfloat16
    copy="import mlora.batch.model.decoder as m; f = m.DecoderModel.forward
m.DecoderModel.forward = lambda *a, **k: f(*a, **k).float()
from mlora.cli.app import app; app()"
    for i in 1 2; do
      timeout 150 python -m mlora bench batch --rows 1024 --adapters 0 --out "$OUT/batch-logits-model-dtype-$i.json" \
        2>&1 | grep adapters | sed 's/^/model dtype: /'
      timeout 150 python -c "$copy" bench batch --rows 1024 --adapters 0 --out "$OUT/batch-logits-float32-$i.json" \
        2>&1 | grep adapters | sed 's/^/float32 copy: /'
    done
    ;;
  chain)  # twenty-fifth session (built on the CPU, not run yet): chained decode (MLORA_CHAIN_DECODE=1): GPU tests and
    # demo x3 with it, the GPU's wait for the host with and without it, then bench batch A/B at 256 and 64 rows (~9 min)
    MLORA_CHAIN_DECODE=1 timeout 150 python -m pytest -q tests/test_batch_lookahead.py tests/test_batch_graphs.py 2>&1 | tail -2
    for dt in float32 bfloat16; do MLORA_CHAIN_DECODE=1 demo_gpu "chain-$dt" "$dt"; done
    MLORA_CHAIN_DECODE=1 MLORA_DEBUG_GRAPHS=1 demo_gpu chain-debug-graphs bfloat16
    for c in 0 1; do
      MLORA_CHAIN_DECODE=$c timeout 100 python scripts/profile_batch.py --rows 256 --adapters 8 --graphs --iters 20 2>&1 \
        | grep -E "per decode|device alone" | sed "s/^/chain $c: /"
    done
    timeout 240 python -m mlora bench batch --rows 1024 --adapters 0,64 --ab MLORA_CHAIN_DECODE=0,1 \
      --out "$OUT/batch-chain.json" 2>&1 | grep -E "adapters"
    timeout 150 python -m mlora bench batch --rows 512 --adapters 0 --max-num-seqs 64 --ab MLORA_CHAIN_DECODE=0,1 \
      --out "$OUT/batch-chain-64.json" 2>&1 | grep -E "adapters"
    ;;
  chain-ab)  # twenty-sixth session: chained decode (now the default) against unchained, reversed order and
    # repeated (the first A/B ran 0 before 1 once: -0.29 ms base, -0.94 with 64 adapters at 256 rows) (~6 min)
    timeout 500 python -m mlora bench batch --rows 1024 --adapters 0,64 --ab MLORA_CHAIN_DECODE=1,0 --ab-repeats 2 \
      --out "$OUT/batch-chain-ab.json" 2>&1 | grep -E "adapters|MLORA"
    ;;
  power)  # twenty-eighth session: full-batch decode ran at the 700 W power cap in every NVML sample, SM at
    # 1,650-1,800 MHz of 1,980; what the ceilings (short bursts) are worth sustained (~2 min)
    timeout 150 python - <<'PY' 2>&1 | tee "$OUT/power.txt"
import torch
from mlora.bench.gpuclocks import ClockSampler
from mlora.bench.kernels import measure_ceilings, sustained_rate
dev = torch.device("cuda")
c = measure_ceilings()
print(f"burst (best of 20): copy {c.copy_bytes_per_s / 1e12:.3f} TB/s, matmul {c.bf16_flops_per_s / 1e12:.0f} TFLOP/s")
def sustained(name, fn, work, unit, seconds=3.0):
    s = ClockSampler(dev, 0.02).start()
    rate, half = sustained_rate(fn, work, seconds, batch=20)
    s.stop()
    print(f"{name} sustained {seconds:.0f} s: {rate / 1e12:.3f} {unit} (second half); clocks {s.summary([half])}")
n = 1 << 30
src = torch.empty(n, dtype=torch.bfloat16, device="cuda"); dst = torch.empty_like(src)
sustained("copy 2 GiB", lambda: dst.copy_(src), 4 * n, "TB/s")
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a)
sustained("matmul 8192^3", lambda: a @ b, 2 * 8192**3, "TFLOP/s")
ws = [torch.randn(28672, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(4)]  # 940 MB: no L2 reuse
x = torch.randn(256, 4096, dtype=torch.bfloat16, device="cuda"); k = [0]
def gu():
    k[0] = (k[0] + 1) % 4
    torch.nn.functional.linear(x, ws[k[0]])
sustained("gate/up GEMM 256 x 4096 x 28672", gu, 2 * 256 * 4096 * 28672, "TFLOP/s")
PY
    ;;
  ceilings)  # twenty-eighth session: how stable the measured ceilings are (the median of 10 moved the copy ceiling
    # 4.14-4.24 TB/s in four runs on one H200), and this machine's clocks; then bench batch with both recorded (~5 min)
    timeout 120 python - <<'PY' 2>&1 | tee "$OUT/ceilings.txt"
import statistics, torch
from mlora.bench.batch import gpu_clocks
from mlora.bench import kernels as kb
dev = torch.device("cuda")
print("clocks", gpu_clocks(dev))
n = 1 << 30
src = torch.empty(n, dtype=torch.bfloat16, device="cuda"); dst = torch.empty_like(src)
for i in range(5):
    med = 4 * n / kb._events_median(lambda: dst.copy_(src), 10)
    best = kb.measure_ceilings()
    print(f"trial {i}: copy median-of-10 {med / 1e12:.3f} TB/s, best-of-20 {best.copy_bytes_per_s / 1e12:.3f} TB/s; "
          f"matmul best-of-20 {best.bf16_flops_per_s / 1e12:.0f} TFLOP/s")
print("clocks", gpu_clocks(dev))
PY
    timeout 400 python -m mlora bench batch --rows 1024 --adapters 0,8,64 --out "$OUT/batch-h200.json" 2>&1 \
      | grep -E "adapters:|TB/s"
    ;;
  sensitivity)  # twenty-eighth session: the bf16 logits bound (2e-2) against what one bf16 rounding of layer 0's
    # normed input alone does to the float32 forward's logits (scripts/logits_check.py), then this machine's
    # decode figures at 0 and 64 adapters (~6 min)
    timeout 240 python scripts/logits_check.py 2>&1 | tail -2 | tee "$OUT/logits-sensitivity.txt"
    timeout 300 python -m mlora bench batch --rows 1024 --adapters 0,64 --out "$OUT/batch-h200.json" 2>&1 | grep -E "adapters:|ceilings"
    ;;
  greedy-ab)  # twenty-seventh session: the Triton greedy choice against torch.argmax inside the engine, base only,
    # 256 and 64 running rows (~5 min)
    timeout 250 python -m mlora bench batch --rows 1024 --adapters 0 --ab MLORA_GREEDY=torch,triton --ab-repeats 2 \
      --out "$OUT/batch-greedy-ab.json" 2>&1 | grep -E "adapters|MLORA"
    timeout 150 python -m mlora bench batch --rows 512 --adapters 0 --max-num-seqs 64 --ab MLORA_GREEDY=torch,triton \
      --out "$OUT/batch-greedy-ab-64.json" 2>&1 | grep -E "adapters|MLORA"
    ;;
  greedy)  # twenty-seventh session: the greedy choice in two Triton launches (mlora.kernels.greedy; the o/down expands
    # fused into the add+norm were measured in the same session, slower, deleted: code in commit e0059e5): GPU tests,
    # demo x2, the argmax timing (~3 min)
    timeout 200 python -m pytest -q tests/test_batch_greedy.py tests/test_batch_graphs.py tests/test_batch_lookahead.py \
      tests/test_batch_sampling.py 2>&1 | tail -2
    for dt in float32 bfloat16; do demo_gpu "greedy-$dt" "$dt" 2>"$OUT/demo-greedy-$dt.err"; done
    timeout 60 python scripts/greedy_bench.py 2>&1 | tee "$OUT/greedy-bench.txt"
    ;;
  compiles)  # twenty-sixth session (built on the CPU, not run): the LoRA kernels no longer specialise on their scalar
    # metadata pointers' alignment or the SiLU launch's tile_cap, and bench batch warms up on a short-prompt chunk
    # too: GPU kernel tests, then the compiles of a 64-adapter bench (32 before, two of them inside the timed
    # prefill: benchmarks/batch-compiles-session26-quick.txt) and its prefill (~3 min)
    timeout 200 python -m pytest -q tests/test_kernels_triton.py tests/test_kernels_act.py tests/test_kernels_slices.py \
      tests/test_batch_fused.py tests/test_kernels_fused.py 2>&1 | tail -1
    timeout 200 python -u scripts/compile_log.py bench batch --rows 1024 --adapters 64 --no-repeat-base \
      > "$OUT/batch-compiles.txt" 2>&1; grep -E "adapters:|compiles$|^ +[0-9]+  " "$OUT/batch-compiles.txt"
    ;;
  gemm-group)  # twenty-fourth session: the base GEMMs at 64 / 256 rows against other cuBLAS call shapes
    # (gemm_probe.py), then the mixed-rank cases (~4 min; the session's run also had column groups of
    # 8 / 16 / 32: no gain, the variants deleted since)
    timeout 300 python -u scripts/gemm_probe.py 2>&1 | tee "$OUT/gemm-probe.txt" | tail -14
    timeout 250 python -u scripts/kernel_sweep.py --mixed 2>&1 | tee "$OUT/kernel-sweep-mixed-group.txt" | tail -24
    ;;
  gemm-ab)  # twenty-fourth session (after gemm-group): the GEMM probe again, then cuBLASLt at 64 rows in the
    # engine (~4 min; the session's run, at commit 493b001, also ran the float32 demo with both knobs and the gate/up
    # split's A/B at 256 rows: the split is gone since, and cuBLASLt is the default up to 64 rows: see blas)
    timeout 200 python -u scripts/gemm_probe.py 2>&1 | tee "$OUT/gemm-probe.txt" | grep -E "gateup|rows, 32"
    timeout 200 python -m mlora bench batch --rows 512 --adapters 0 --max-num-seqs 64 \
      --ab "MLORA_BLAS_ROWS=off,1:128" --ab-repeats 2 --out "$OUT/batch-64seqs-blas.json" 2>&1 | grep -E "adapters MLORA"
    ;;
  blas)  # twenty-fourth session: cuBLASLt for forwards of up to 64 rows made the default (mlora.batch.model.gemms; 128 since):
    # GPU model and graph tests, the demo x3, the 8B bf16 logits check, then whether 256 rows gain too (~7 min)
    timeout 150 python -m pytest -q tests/test_batch_model.py tests/test_batch_graphs.py 2>&1 | tail -1
    for dt in float32 bfloat16; do demo_gpu "blas-$dt" "$dt" 2>"$OUT/demo-blas-$dt.err"; done
    MLORA_DEBUG_GRAPHS=1 demo_gpu blas-debug-graphs bfloat16
    timeout 150 python scripts/logits_check.py 2>&1 | tail -2
    timeout 220 python -m mlora bench batch --rows 1024 --adapters 0 --ab "MLORA_BLAS_ROWS=1:64,1:512" \
      --ab-repeats 2 --out "$OUT/batch-256seqs-blas.json" 2>&1 | grep -E "adapters MLORA"
    ;;
  gc-batch)  # twenty-second session: the collector's pauses in decode (bench batch prints them per job) and
    # MLORA_GC=device-wait against the default, 64 and 256 running rows, base only (~4 min)
    timeout 200 python -m mlora bench batch --rows 512 --adapters 0 --max-num-seqs 64 \
      --ab "MLORA_GC=default,device-wait" --ab-repeats 2 --out "$OUT/batch-64seqs-gc.json" 2>&1 | grep -E "adapters MLORA"
    timeout 250 python -m mlora bench batch --rows 1024 --adapters 0,64 --ab "MLORA_GC=default,device-wait" \
      --out "$OUT/batch-256seqs-gc.json" 2>&1 | grep -E "adapters MLORA"
    ;;
  joint-all)  # twenty-second session: the joint ledger with adapters on every linear module (the fused gate/up
    # SiLU product over arena-strided banks, not yet run on a GPU): 64 adapters, 16 slots, 2,000 rows, split
    # then joint, tokens compared row by row (~5 min)
    rm -rf /tmp/bb /tmp/rb
    timeout 150 python -m pytest -q tests/test_residency_arena.py 2>&1 | tail -1
    for ledger in split joint; do
      timeout 200 python -m mlora bench residency /tmp/rba --adapters 64 --rows 2000 --slots 16 --runs limited \
        --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --memory-ledger $ledger \
        --out "$OUT/residency-all-modules-$ledger.json" 2>&1 | grep -E -A2 "^limited|floor|Error"
      rm -rf "/tmp/out-$ledger"; cp -r /tmp/rba/out-limited "/tmp/out-$ledger"
    done
    python scripts/same_outputs.py /tmp/out-split /tmp/out-joint
    ;;
  resident)
    rm -rf /tmp/bb  # the bundle workspace (35 GB) would not fit beside this one (30 GB)
    # with the limited run's JSON of the call before (copy it to /tmp/residency-limited.json there) for the ratio
    cmp=""; [ -f /tmp/residency-limited.json ] && cmp="--compare /tmp/residency-limited.json"
    timeout 560 python scripts/sample_engine.py --out "$OUT/prof-resident.txt" -- bench residency /tmp/rb --adapters 1000 \
      --rows 8000 --runs all-resident $cmp --out "$OUT/residency-all-resident.json" 2>&1 | tail -12
    ;;
  bundle-data)  # step 5 serving benchmark, part 1: the bundle operators' GPU tests, then the Mistral-7B base,
    # 1,024 adapters and the bundle (compression timed; ~7 min on the H200, thirteenth session)
    timeout 90 python -m pytest -q tests/test_bundle_triton.py tests/test_bundle_serving.py 2>&1 | tail -2
    rm -rf /tmp/rb /tmp/cb7  # 35 GB of workspace: the residency one (30 GB) would not fit beside it on a 64 GB disk
    timeout 480 python -m mlora bench bundle /tmp/bb --runs none --out "$OUT/bundle-data.json" 2>&1 | tail -8
    ;;
  bundle)  # part 2 (the workspace of part 1 is reused when the machine is still warm): the four runs (each after
    # an untimed 256-row warm-up job; ~6.5 min with them, fourteenth session: 5.5 min without), in the
    # order bundle, base, bundle through the Triton operator, adapters uncompressed (each printed as it ends)
    timeout 570 python -m mlora bench bundle /tmp/bb --runs bundle,base,bundle-triton,adapters \
      --out "$OUT/bundle-h200.json" 2>&1 | grep -v "modules fitted" | tail -20
    ;;
  bundle-triton)  # part 3, same workspace: the bundle through the Triton operator (tests first), against the torch one
    timeout 120 python -m pytest -q tests/test_bundle_triton.py tests/test_bundle_serving.py 2>&1 | tail -2
    timeout 450 python -m mlora bench bundle /tmp/bb --runs bundle,bundle-triton --out "$OUT/bundle-triton-h200.json" \
      2>&1 | tail -12
    ;;
  compress)
    [ -d /tmp/cb7/adapters ] || timeout 200 python examples/make_compress_bench_data.py /tmp/cb7/adapters --adapters 1000 \
      --shape mistral-7b --shared-rank 48
    rm -rf /tmp/cb7/bundle
    /usr/bin/time -f "compress wall %e s, peak RSS %M KB" timeout 330 python -m mlora compress /tmp/cb7/adapters \
      -o /tmp/cb7/bundle --rank 64 --clusters 8 --device cuda --max-error 0.6 --json > "$OUT/compress-h200.json" \
      2> "$OUT/compress-h200.err"
    tail -2 "$OUT/compress-h200.err"; head -c 600 "$OUT/compress-h200.json"; echo
    grep -c "/96 " "$OUT/compress-h200.err"  # modules finished (progress lines; also when stopped by the limit)
    timeout 100 python scripts/compress_profile.py 1000 4096 4096 64 8 --device cuda 2>&1 | tail -12  # one module, by part
    ;;
esac
