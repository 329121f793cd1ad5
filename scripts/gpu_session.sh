#!/usr/bin/env bash
# GPU runs of mlora from the repository root, on a machine with torch, triton, transformers and peft
# installed (mlora runs from the tree via PYTHONPATH, no install, no network). Results go to $OUT
# (default ./gpu-out). Each mode fits one 10-minute device call.
#   bash scripts/gpu_session.sh tests [PYTEST_ARGS]   the GPU test suite, then the Triton compile check at the GPU's arch
#   bash scripts/gpu_session.sh demo                  the demo job on the GPU in float32 and bfloat16, checked
#   bash scripts/gpu_session.sh kernels [OPTIONS]     mlora bench kernels (JSON: $OUT/kernels.json)
#   bash scripts/gpu_session.sh batch [OPTIONS]       mlora bench batch (default --rows 1024 --adapters 0,8,64)
#   bash scripts/gpu_session.sh tp-batch [OPTIONS]    mlora bench batch --tensor-parallel-size 2 on GPUs 0 and 1
#       (JSON: $OUT/tp-batch.json; the adapters' PEFT files in /tmp/mlora-tp-adapters, not $OUT, reused by a
#       rerun of the same preset). Without OPTIONS the Llama-3-8B shape, `--rows 1024 --adapters 0,8` (issue 40's
#       job; the base again last): about 5 minutes, per scenario a group starts (~20 s), warms up and captures
#       its graphs (~30 s; Triton compiles on top the first time) and runs (~20 s). The Llama-3-70B shape, its
#       weights generated on each GPU (no checkpoint):
#         bash scripts/gpu_session.sh tp-batch --preset llama-3-70b --rows 512 --adapters 0,8 --no-repeat-base
#       (about 5 minutes: ~30 s prefill and ~10 s decode timed per scenario, as long again for the warm-up,
#       8 adapters of 0.4 GB written; per rank 73 GB of weights and 48 GB of KV cache). Estimates, not yet
#       measured: if a call runs short, add --no-repeat-base (8B) or use --rows 256 (70B); --no-cuda-graphs
#       runs the decode steps eagerly if graph capture under tensor parallelism fails.
#   bash scripts/gpu_session.sh compare REV_A REV_B   speed of two revisions on this GPU: bench batch and bench
#       kernels from tree A and tree B alternately (A B A B), JSON per run in $OUT, then a table of B/A.
#       REV is a git revision (its mlora/ extracted with git archive) or a folder holding a tree's mlora/.
#       Where there is no .git (the device machine), extract here and carry the folders:
#         for t in a b; do mkdir -p .ab/$t; git archive REV_$t mlora | tar -x -C .ab/$t; done   # .ab in .git/info/exclude
#       then run `compare .ab/a .ab/b`. BATCH_ARGS / KERNEL_ARGS override the bench options, ROUNDS the rounds
#       (2), BENCHES the benches ("batch kernels"; one per device call if both overrun its 10 minutes).
#   bash scripts/gpu_session.sh gpus2 [demo] [bench] [tiny]   two GPUs of one host (nvidia-h200-x2), in order:
#       demo: the demo job in float32 on GPU 0, with --gpus 0,1 and with --gpus 0,1 --tensor-parallel-size 2
#         (NCCL), each checked against expected.json and the two scaled runs against the one-GPU run's rows;
#       bench: mlora bench gpus at issue 40's size (Llama-3-8B shape, bf16, 1,024 rows, 8 adapters): one GPU,
#         --gpus 0,1 and TP=2, tokens/s and speed-ups ($OUT/gpus2-bench.json; workspace /tmp/mlora-gpus2, reused);
#       tiny: the same three runs on the tiny preset in float32 (outputs_equal: rows equal the one-GPU run's).
#       Estimate: demo ~2 min (Triton compiles in the first run), bench ~4 min (16 GB checkpoint written, then
#       three runs each loading it from the page cache), tiny ~1 min: one call. Each part gets what is left of
#       570 s; if one overruns, rerun the parts left (`gpus2 bench tiny`) in a second call.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH=$PWD COLUMNS=${COLUMNS:-200}  # COLUMNS: rich's tables unwrapped in a pipe

# the GPU tests: tensor parallelism with both ranks on one GPU (over gloo) first, then the engine, attention,
# graphs, model, kernels, residency and bundle operators on CUDA
GPU_TESTS="tests/test_tp_engine.py::test_demo_job_at_two_ranks_gives_the_expected_rows
  tests/test_tp_engine.py::test_demo_job_at_two_ranks_in_one_arena_gives_the_expected_rows
  tests/test_tp_engine.py::test_lora_on_all_modules_at_two_ranks_equals_one_rank
  tests/test_tp_bundle.py::test_a_bundle_job_at_two_ranks_sharing_one_gpu_equals_one_rank tests/test_tp_kernels.py
  tests/test_batch_graphs.py tests/test_batch_attention.py tests/test_batch_model.py tests/test_batch_fused.py
  tests/test_batch_lookahead.py tests/test_batch_greedy.py tests/test_batch_sampling.py tests/test_batch_catalog.py
  tests/test_kernels_triton.py tests/test_kernels_slices.py tests/test_kernels_act.py tests/test_kernels_pitch.py
  tests/test_kernels_spec.py tests/test_residency.py tests/test_residency_validate.py tests/test_residency_pinned.py
  tests/test_bundle_serving.py tests/test_bundle_triton.py tests/test_batch_prefix.py
  tests/test_batch_bench.py::test_recording_engine_records_chained_iterations_too"

case "${1:-}" in
  tests)
    shift
    # shellcheck disable=SC2086
    [ $# -gt 0 ] || set -- $GPU_TESTS
    timeout 420 "$PY" -m pytest -q "$@" 2>&1 | tail -15
    arch=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)')
    if timeout 150 "$PY" scripts/compile_kernels.py --arch "$arch" >"$OUT/compile-kernels.txt" 2>&1; then
      echo "compile_kernels sm_$arch: $(grep -c '^ok ' "$OUT/compile-kernels.txt") kernels compiled"
    else
      echo "compile_kernels sm_$arch FAILED:"; tail -5 "$OUT/compile-kernels.txt"
    fi
    ;;
  demo)
    for dt in float32 bfloat16; do
      rm -rf "/tmp/demo-$dt"
      timeout 120 "$PY" -m mlora batch-run examples/demo/prompts.parquet "/tmp/demo-$dt" --base examples/demo/base \
        --adapters examples/demo/adapters --max-new-tokens 40 --device cuda --dtype "$dt" -q >/dev/null 2>"$OUT/demo-$dt.err"
      echo "demo $dt: $("$PY" scripts/check_demo_outputs.py "/tmp/demo-$dt" 2>&1 | tail -1)"
    done
    ;;
  kernels)
    shift
    timeout 580 "$PY" -m mlora bench kernels --out "$OUT/kernels.json" "$@" >"$OUT/kernels.txt" 2>&1
    tail -25 "$OUT/kernels.txt"
    ;;
  batch)
    shift
    [ $# -gt 0 ] || set -- --rows 1024 --adapters 0,8,64
    timeout 580 "$PY" -m mlora bench batch --out "$OUT/batch.json" "$@" 2>&1
    ;;
  tp-batch)
    shift
    [ $# -gt 0 ] || set -- --rows 1024 --adapters 0,8
    timeout 580 "$PY" -m mlora bench batch --tensor-parallel-size 2 --adapters-dir /tmp/mlora-tp-adapters \
      --out "$OUT/tp-batch.json" "$@" 2>&1
    ;;
  compare)
    [ $# -eq 3 ] || { echo "usage: $0 compare REV_A REV_B" >&2; exit 2; }
    trees=$(mktemp -d)
    trap 'rm -rf "$trees"' EXIT
    for t in A B; do
      rev=$([ $t = A ] && echo "$2" || echo "$3")
      if [ -f "$rev/mlora/__main__.py" ]; then
        ln -s "$(cd "$rev" && pwd)" "$trees/$t"
      else
        mkdir "$trees/$t"
        git archive "$rev" mlora | tar -x -C "$trees/$t" || { echo "cannot extract $rev" >&2; exit 1; }
      fi
      [ -f "$trees/$t/mlora/__main__.py" ] || { echo "$rev: no mlora/__main__.py" >&2; exit 1; }
      echo "$t = $rev"
    done
    for round in $(seq "${ROUNDS:-2}"); do
      for t in A B; do
        for bench in ${BENCHES:-batch kernels}; do
          args=$([ $bench = batch ] && echo "${BATCH_ARGS:---rows 512 --adapters 0,8,64 --no-repeat-base}" \
                 || echo "${KERNEL_ARGS:---quick --no-baselines}")
          start=$SECONDS log="$trees/$bench-$t-$round.log"
          # shellcheck disable=SC2086
          if (cd "$trees/$t" && PYTHONPATH=$PWD "$PY" -m mlora bench $bench $args --json \
                --out "$OUT/$bench-$t-$round.json") >"$log" 2>&1; then
            echo "round $round $t $bench: $((SECONDS - start)) s"
          else
            echo "round $round $t $bench FAILED:"; tail -5 "$log"
          fi
        done
      done
    done
    "$PY" scripts/compare_table.py "$OUT"
    ;;
  gpus2)
    shift
    [ $# -gt 0 ] || set -- demo bench tiny
    end=$((SECONDS + 570))
    for part in "$@"; do
      left=$((end - SECONDS))
      [ "$left" -gt 20 ] || { echo "gpus2 $part: no time left in this call; run \`gpus2 $part\` in the next"; continue; }
      case $part in
        demo)
          for run in one replicas tp; do
            case $run in
              one) args="--device cuda" ;;
              replicas) args="--gpus 0,1" ;;
              tp) args="--gpus 0,1 --tensor-parallel-size 2" ;;
            esac
            rm -rf "/tmp/demo2-$run"
            # shellcheck disable=SC2086
            timeout $((end - SECONDS)) "$PY" -m mlora batch-run examples/demo/prompts.parquet "/tmp/demo2-$run" \
              --base examples/demo/base --adapters examples/demo/adapters --max-new-tokens 40 --dtype float32 $args \
              -q >/dev/null 2>"$OUT/demo2-$run.err"
            rc=$?
            echo "demo float32 $run ($args, exit $rc): $("$PY" scripts/check_demo_outputs.py "/tmp/demo2-$run" 2>&1 | tail -1)"
            [ $rc -eq 0 ] || tail -3 "$OUT/demo2-$run.err"
            [ $run = one ] || echo "  $run against one: $("$PY" scripts/check_demo_outputs.py "/tmp/demo2-$run" \
                                  /tmp/demo2-one 2>&1 | tail -1)"
          done
          ;;
        bench)
          # progress lines (stderr) carry each run's figures, so a run cut short by the timeout leaves the earlier ones
          timeout "$left" "$PY" -m mlora bench gpus /tmp/mlora-gpus2 --gpus 0,1 --tensor-parallel-size 2 --adapters 8 \
            --rows 1024 --out "$OUT/gpus2-bench.json" 2>&1 | grep -v 'adapters written' | tee "$OUT/gpus2-bench.txt"
          ;;
        tiny)
          timeout "$left" "$PY" -m mlora bench gpus /tmp/mlora-gpus2-tiny --preset tiny --dtype float32 --gpus 0,1 \
            --tensor-parallel-size 2 --adapters 8 --rows 256 --prompt-min 8 --prompt-max 64 --max-new-tokens 32 \
            --out "$OUT/gpus2-tiny.json" 2>&1 | tee "$OUT/gpus2-tiny.txt" | grep -E '^(one|replicas|tp):|outputs equal|Error'
          ;;
        *) echo "gpus2: parts are demo, bench and tiny, not $part" >&2; exit 2 ;;
      esac
    done
    ;;
  *)
    sed -n 2,35p "$0"; exit 2
    ;;
esac
