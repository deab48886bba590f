#!/usr/bin/env bash
# scripts/gpu_run.sh, the GPU bundle's run.sh, end to end under kernel
# emulation (Note [kernel emulation] in cuda_emu.h), so that a GPU session
# does not find its bugs first. A bundle folder is laid out as
# scripts/gpu_bundle.sh lays it out, its bin/ running the emulated binaries
# at toy sizes (zinc-bench --tiny in place of the sizes run.sh asks for,
# zinc-train for two steps, the kernel tests' GPU profile suite for each
# test binary). Checked: every part runs in order and says so, each zinc
# benchmark item leaves one JSON line (the variants with the switches they
# set), the results folder holds only the files run.sh names, the table of
# aims ends the run, a spent time budget skips every item with a line, and
# an unknown part is refused. The PyTorch peer fails here without torch;
# run.sh goes on past it, as it must on a machine where it breaks.
# usage: run_sh_test.sh ZINC_TRAIN_EMU ZINC_BENCH_EMU CUDA_EMU_TEST SOURCE_DIR
set -u
train=$1 bench=$2 kernels=$3 src=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
check() {  # check WHAT COMMAND...: the command must succeed
  local what=$1
  shift
  if ! "$@"; then
    echo "FAIL: $what"
    fail=1
  fi
}

b=$tmp/bundle
mkdir -p "$b/bin" "$b/configs" "$b/bench"
cp "$src/scripts/gpu_run.sh" "$b/run.sh"
cp "$src"/configs/*.json "$b/configs/"
cp "$src/bench/gpu_summary.py" "$src/bench/torch_gpt_peer.py" "$b/bench/"
cat >"$b/bin/zinc-bench" <<WRAP
#!/usr/bin/env bash
# The emulated zinc-bench at the tiny sizes: run.sh's sizes and rounds dropped.
args=()
while [ \$# -gt 0 ]; do
  case "\$1" in
    --large) ;;
    --rounds|--steps) shift ;;
    *) args+=("\$1") ;;
  esac
  shift
done
exec "$bench" "\${args[@]}" --tiny --rounds 1 --steps 1 --gas 2
WRAP
cat >"$b/bin/zinc-train" <<WRAP
#!/usr/bin/env bash
exec "$train" "\$@" --set run.steps=2 --set run.eval_interval=0 --set run.output_dir="$tmp/train.\$\$"
WRAP
for t in cuda_kernels_test cuda_optim_test cuda_engine_test; do
  printf '#!/usr/bin/env bash\nexec "%s" --gtest_filter=CudaProfile.*\n' "$kernels" >"$b/bin/$t"
done
chmod +x "$b"/bin/* "$b/run.sh"

out=$tmp/out.txt
res=$tmp/res
bash "$b/run.sh" "$res" all >"$out" 2>&1
echo "run.sh all: exit status $? (1 expected where the PyTorch peer cannot run)"
# The parts, in order.
check "the parts in order" awk '
  /^== tests done at/ {t = NR} /^== benchmarks done at/ {b = NR} /^== training runs done at/ {r = NR}
  /^== deepspeed done at/ {d = NR} /^== profile done at/ {p = NR} /^== the aims/ {a = NR}
  END { exit !(t && b > t && r > b && d > r && p > d && a > p) }' "$out"
check "the kernel tests ran" grep -q "PASSED.*5 tests" "$out"
check "the training runs ran" test "$(grep -c 'final loss' "$out")" -ge 2
check "the DeepSpeed part says why it skips" grep -q "deepspeed peer: skipped: the bundle carries no DeepSpeed wheels" "$out"
# One JSON line a zinc benchmark item; the variants carry their switches.
items=$(grep -c '^zinc_bench ' "$src/scripts/gpu_run.sh")
lines=$(grep -c '^{"' "$res/gpu-train-step.jsonl")
check "a JSON line for each of the $items zinc items (found $lines)" test "$lines" -eq "$items"
check "the variants name their switches" python3 -c '
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
envs = [l["env"] for l in lines]
assert {"ZINC_GPU_UPDATE_BEHIND": "0"} in envs and {"ZINC_CUDA_MATMUL_BIAS": "separate"} in envs, envs
assert sum(1 for l in lines if "gpu_profile" in l) == 5, "five items profile"
' "$res/gpu-train-step.jsonl"
check "the results folder holds only run.sh's files" python3 -c '
import os, sys
names = set(os.listdir(sys.argv[1]))
allowed = {"run.log", "gpu-train-step.jsonl", "torch-peer.jsonl", "deepspeed-peer.jsonl", "gpu-step-profile.txt"}
assert names <= allowed and "run.log" in names, names
' "$res"
check "run.log holds all of stdout" grep -q "^== the aims" "$res/run.log"
check "the table of aims ends the run" grep -q "| 355M GPT | states on the GPU / PyTorch" "$out"

# A spent budget: every item skipped with a line, nothing measured.
before=$(wc -l <"$res/gpu-train-step.jsonl")
ZINC_BUNDLE_BUDGET_S=1 bash "$b/run.sh" "$res" bench,train >"$out" 2>&1
check "a spent budget skips every item" grep -q "item(s) skipped for the time budget" "$out"
check "and measures nothing" test "$(wc -l <"$res/gpu-train-step.jsonl")" -eq "$before"
check "each skip has its line" test "$(grep -c '^skipped, the 1 s budget is spent' "$out")" -gt "$items"

# Refusals: an unknown part, a budget that is not whole seconds.
bash "$b/run.sh" "$res" tests,nope >"$out" 2>&1
check "an unknown part is refused" test $? -eq 2
check "  and named" grep -q "unknown part 'nope'" "$out"
ZINC_BUNDLE_BUDGET_S=9m bash "$b/run.sh" "$res" tests >"$out" 2>&1
check "a budget in minutes is refused" test $? -eq 2
[ "$fail" -ne 0 ] && { echo "--- the last run.sh output:"; tail -30 "$out"; }
exit $fail
