#!/usr/bin/env bash
# The GPU check: what distamp needs a GPU to show, in at most eight minutes, into at most eight files.
#
#   pip install -e '.[test]'                 # once, from the repo root (torch comes with the GPU image)
#   bash examples/gpu_check.sh OUT_DIR       # from the repo root
#   bash examples/gpu_check.sh --dry-run     # print the plan only (also what a machine without a GPU does)
#
# Installs nothing. Each step runs under its own `timeout`, so a hang costs only that step's
# seconds; the budgets below add up to 480 s. Files in OUT_DIR (8):
#   env.txt          GPU, driver, torch, CUDA, NCCL, Python versions
#   cuda_tests.txt   pytest -m cuda tests/cuda -rA
#   digits.txt       examples/train_digits.py, 900 steps on GPU 0: FP32, FP16 O1, FP16 O2, BF16 O2,
#                    BF16 O2 stage 2, BF16 stage 3, FP16 O2 PowerSGD (concurrently, each its own out dir)
#   bench_eager.txt  examples/benchmark.py, GPT 185.76M (d_model 1024, 12 layers, 16 heads, vocab 32768,
#                    seq 1024, batch 8): FP32, torch BF16/FP16, distamp O1/O2 BF16/FP16; peak memory probes;
#                    then examples/step_phases.py on it: forward, backward and update apart, torch against O2
#   bench_compiled.txt  the same GPT with --compile: torch and distamp O2, BF16 and FP16 (no probes: a probe
#                    compiles again in its own process, which the budget does not hold)
#   peak_breakdown.txt  examples/peak_breakdown.py on the same GPT, torch BF16 and distamp O2 BF16 (side by
#                    side, each its own process): what CUDA's allocator holds at each one's peak, by origin
#   nccl_2rank.txt   with >= 2 GPUs: distrun --gpus 0,1 train_digits.py in lockstep (BF16 O2), stage 2,
#                    stage 3 and PowerSGD, each with its own --log_dir
#   summary.txt      one line per step: pass/fail, seconds, a figure
set -u

usage() { echo "usage: bash examples/gpu_check.sh OUT_DIR | --dry-run" >&2; exit 2; }

DRY=0
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) usage ;;
    *) OUT="$arg" ;;
  esac
done
PY="${PYTHON:-python}"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's distamp, installed or not

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1 && "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
fi

GPT="--model gpt --d_model 1024 --layers 12 --heads 16 --vocab 32768 --seq_len 1024 --batch 8"
EAGER_MODES="fp32,torch_bf16,torch_fp16,distamp_o1_bf16,distamp_o2_bf16,distamp_o1_fp16,distamp_o2_fp16"
COMPILED_MODES="torch_bf16,distamp_o2_bf16,torch_fp16,distamp_o2_fp16"
DIGITS_STEPS=900
declare -A DIGITS=(
  [fp32]="--no_amp"
  [fp16_o1]="--dtype float16"
  [fp16_o2]="--dtype float16 --pure_fp16"
  [bf16_o2]="--dtype bfloat16 --pure_fp16"
  [bf16_o2_stage2]="--dtype bfloat16 --pure_fp16 --sharding_stage 2"
  [bf16_stage3]="--dtype bfloat16 --sharding_stage 3"
  [fp16_o2_powersgd]="--dtype float16 --pure_fp16 --powersgd_rank 2"
)
DIGITS_ORDER="fp32 fp16_o1 fp16_o2 bf16_o2 bf16_o2_stage2 bf16_stage3 fp16_o2_powersgd"
declare -A NCCL=(
  [lockstep_bf16_o2]="--dtype bfloat16 --pure_fp16"
  [stage2]="--dtype bfloat16 --pure_fp16 --sharding_stage 2"
  [stage3]="--dtype bfloat16 --sharding_stage 3"
  [powersgd]="--dtype float16 --pure_fp16 --powersgd_rank 2"
)
NCCL_ORDER="lockstep_bf16_o2 stage2 stage3 powersgd"
# seconds per step
T_ENV=10
T_TESTS_AND_DIGITS=75
T_EAGER=170
T_COMPILED=110
T_BREAKDOWN=45
T_NCCL=45
T_PHASES=25
PHASE_MODES="torch_bf16,distamp_o2_bf16,torch_fp16,distamp_o2_fp16"

plan() {
  echo "gpu_check plan ($GPUS GPU(s) visible; step budgets add up to $((T_ENV + T_TESTS_AND_DIGITS + T_EAGER + T_PHASES + T_COMPILED + T_BREAKDOWN + T_NCCL)) s):"
  echo "  step env: ${T_ENV} s -> env.txt (nvidia-smi; torch, CUDA, NCCL, Python versions)"
  echo "  step cuda_tests: ${T_TESTS_AND_DIGITS} s, alongside the digits -> cuda_tests.txt: $PY -m pytest -m cuda tests/cuda -rA"
  for name in $DIGITS_ORDER; do
    echo "  step digits_$name: ${T_TESTS_AND_DIGITS} s, concurrent -> digits.txt: $PY examples/train_digits.py ${DIGITS[$name]} --max_steps $DIGITS_STEPS --no_progress"
  done
  echo "  step bench_eager: ${T_EAGER} s -> bench_eager.txt: $PY examples/benchmark.py $GPT --modes $EAGER_MODES --reps 2 --steps 5 --warmup 2 --probe_steps 2"
  echo "  step step_phases: ${T_PHASES} s -> bench_eager.txt (appended): $PY examples/step_phases.py $GPT --modes $PHASE_MODES --steps 4 --warmup 2"
  echo "  step bench_compiled: ${T_COMPILED} s -> bench_compiled.txt: $PY examples/benchmark.py $GPT --compile --modes $COMPILED_MODES --reps 2 --steps 5 --warmup 2 --probe_steps 0"
  echo "  step peak_breakdown: ${T_BREAKDOWN} s -> peak_breakdown.txt: $PY examples/peak_breakdown.py $GPT --mode torch_bf16|distamp_o2_bf16 --steps 3 (both at once)"
  for name in $NCCL_ORDER; do
    echo "  step nccl_2rank_$name: ${T_NCCL} s, concurrent, only with >= 2 GPUs -> nccl_2rank.txt: distrun --gpus 0,1 --log_dir LOGS/$name examples/train_digits.py ${NCCL[$name]} --max_steps 200 --no_progress"
  done
  echo "  summary -> summary.txt (8 files in OUT_DIR at most)"
}

if [ "$DRY" = 1 ] || [ "$GPUS" -lt 1 ]; then
  plan
  if [ "$DRY" = 0 ]; then echo "no CUDA GPU here (nvidia-smi missing or torch.cuda.is_available() False): plan only"; fi
  exit 0
fi
[ -n "$OUT" ] || usage
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$HERE" || exit 1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$SECONDS

# record NAME RC SECONDS FIGURE
record() {
  local verdict=pass
  if [ "$2" = 124 ] || [ "$2" = 137 ]; then verdict="fail (timed out)"; elif [ "$2" != 0 ]; then verdict="fail (exit $2)"; fi
  printf '%-28s %-18s %4ss  %s\n' "$1" "$verdict" "$3" "$4" >> "$SUMMARY"
}

# --- env
t0=$SECONDS
{
  nvidia-smi
  timeout "$T_ENV" "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
EOF
} > "$OUT/env.txt" 2>&1
rc=$?
record env "$rc" $((SECONDS - t0)) "$(grep -m1 '^torch ' "$OUT/env.txt")"

# --- cuda tests and the digits runs, side by side on GPU 0
t0=$SECONDS
timeout -k 5 "$T_TESTS_AND_DIGITS" "$PY" -m pytest -m cuda tests/cuda -rA -q -p no:cacheprovider \
  > "$OUT/cuda_tests.txt" 2>&1 &
tests_pid=$!
declare -A DIGITS_PID=()
declare -A BREAKDOWN_PID=()
for name in $DIGITS_ORDER; do
  # shellcheck disable=SC2086  # the flags are words
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$T_TESTS_AND_DIGITS" "$PY" examples/train_digits.py ${DIGITS[$name]} \
    --max_steps "$DIGITS_STEPS" --no_progress --out_dir "$WORK/digits/$name" > "$WORK/digits_$name.txt" 2>&1 &
  DIGITS_PID[$name]=$!
done
wait "$tests_pid"
rc=$?
record cuda_tests "$rc" $((SECONDS - t0)) "$(tail -n 1 "$OUT/cuda_tests.txt")"
for name in $DIGITS_ORDER; do
  wait "${DIGITS_PID[$name]}"
  rc=$?
  { echo "===== digits $name: train_digits.py ${DIGITS[$name]} (exit $rc)"; cat "$WORK/digits_$name.txt"; } >> "$OUT/digits.txt"
  record "digits_$name" "$rc" $((SECONDS - t0)) "$(grep -m1 -o 'test_accuracy=[0-9.]*' "$WORK/digits_$name.txt")"
done

# --- the GPT benchmark, eager then compiled (alone on the GPU: these are timings)
bench() {  # NAME SECONDS FILE FLAGS...
  local name=$1 limit=$2 file=$3
  shift 3
  t0=$SECONDS
  # shellcheck disable=SC2086
  timeout -k 5 "$limit" "$PY" examples/benchmark.py $GPT "$@" --json "$WORK/$name.json" > "$OUT/$file" 2>&1
  rc=$?
  record "$name" "$rc" $((SECONDS - t0)) "$(grep -m1 -E 'distamp_o2_bf16' "$OUT/$file" | tr -s ' ' | cut -c1-100)"
}
bench bench_eager "$T_EAGER" bench_eager.txt --modes "$EAGER_MODES" --reps 2 --steps 5 --warmup 2 --probe_steps 2
t0=$SECONDS
{
  echo
  echo "===== step_phases.py: forward, backward and update apart"
  # shellcheck disable=SC2086
  timeout -k 5 "$T_PHASES" "$PY" examples/step_phases.py $GPT --modes "$PHASE_MODES" --steps 4 --warmup 2
} >> "$OUT/bench_eager.txt" 2>&1
rc=$?
record step_phases "$rc" $((SECONDS - t0)) "$(grep -m1 '^| distamp_o2_bf16 |' "$OUT/bench_eager.txt" | tr -s ' ' | cut -c1-100)"
bench bench_compiled "$T_COMPILED" bench_compiled.txt --compile --modes "$COMPILED_MODES" --reps 2 --steps 5 \
  --warmup 2 --probe_steps 0

# --- what is alive at the peak, torch-native BF16 beside distamp O2 BF16 (memory only: side by side is fine)
t0=$SECONDS
for mode in torch_bf16 distamp_o2_bf16; do
  # shellcheck disable=SC2086
  timeout -k 5 "$T_BREAKDOWN" "$PY" examples/peak_breakdown.py $GPT --mode "$mode" --steps 3 --top 12 \
    > "$WORK/breakdown_$mode.txt" 2>&1 &
  BREAKDOWN_PID[$mode]=$!
done
for mode in torch_bf16 distamp_o2_bf16; do
  wait "${BREAKDOWN_PID[$mode]}"
  rc=$?
  { echo "===== peak_breakdown.py --mode $mode (exit $rc)"; grep -v '^USDT' "$WORK/breakdown_$mode.txt"; echo; } \
    >> "$OUT/peak_breakdown.txt"
  record "peak_breakdown_$mode" "$rc" $((SECONDS - t0)) "$(grep -m1 -o 'peak [0-9.]* MiB = [0-9.]* bytes/param' \
    "$WORK/breakdown_$mode.txt")"
done

# --- two NCCL ranks (never run on a GPU before this check)
if [ "$GPUS" -ge 2 ]; then
  t0=$SECONDS
  declare -A NCCL_PID=()
  for name in $NCCL_ORDER; do
    # shellcheck disable=SC2086
    timeout -k 10 "$T_NCCL" "$PY" -m distamp.launcher --gpus 0,1 --log_dir "$WORK/logs/$name" \
      examples/train_digits.py ${NCCL[$name]} --max_steps 200 --no_progress --out_dir "$WORK/nccl/$name" \
      > "$WORK/nccl_$name.txt" 2>&1 &
    NCCL_PID[$name]=$!
  done
  for name in $NCCL_ORDER; do
    wait "${NCCL_PID[$name]}"
    rc=$?
    {
      echo "===== nccl 2 ranks $name: distrun --gpus 0,1 train_digits.py ${NCCL[$name]} (exit $rc)"
      cat "$WORK/nccl_$name.txt"
      for log in "$WORK/logs/$name"/workerlog.*; do echo "----- $log"; tail -n 30 "$log"; done
    } >> "$OUT/nccl_2rank.txt" 2>&1
    record "nccl_2rank_$name" "$rc" $((SECONDS - t0)) "$(grep -m1 -o 'test_accuracy=[0-9.]*' "$WORK/nccl_$name.txt")"
  done
else
  printf '%-28s %-18s %4ss  %s\n' nccl_2rank "skipped" 0 "$GPUS GPU(s): needs 2" >> "$SUMMARY"
fi

echo "total $((SECONDS - START)) s" >> "$SUMMARY"
cat "$SUMMARY"
if grep -q ' fail' "$SUMMARY"; then exit 1; fi
exit 0
