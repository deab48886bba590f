#!/usr/bin/env bash
# zinc-train given hostile config input (issue 27, items 7 and 14): each case
# ends with one line naming the file or option, the place and the rule, the
# exit code of a bad config (1) or of a bad command line (2), and never a
# crash, for a training run and for --check alike.
# Usage: config_cli_test.sh ZINC_TRAIN REPO_ROOT
set -u
ZT="$1"
ROOT="$2"
CFG="$ROOT/configs/default.json"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0

# name, exit code, expected substring, args...: the exit code, the expected
# text (on stderr; --check reports a refusal on stdout), no crash and no
# library's message, and for a run refused with exit code 1 one error line.
expect() {
  local name="$1" want_rc="$2" want="$3"
  shift 3
  timeout 60 "$ZT" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local lines one=1
  lines="$(grep -vc '^zinc\[' "$TMP/err")"
  case " $* " in *" --check "*) one=0 ;; esac
  if [ "$rc" -eq "$want_rc" ] && cat "$TMP/out" "$TMP/err" | grep -qF -- "$want" &&
     { [ "$want_rc" -ne 1 ] || [ "$one" -eq 0 ] || [ "$lines" -eq 1 ]; } &&
     ! cat "$TMP/out" "$TMP/err" |
       grep -qiE 'terminate called|Aborted|Segmentation|core dumped|json\.exception|stoul|not in range'; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAIL $name: rc=$rc (want $want_rc), want '$want'; stderr:"
    head -c 2000 "$TMP/err"
    echo
  fi
}

python3 - "$CFG" "$TMP" <<'PY'
import sys
cfg, tmp = sys.argv[1], sys.argv[2]
text = open(cfg).read()
open(f"{tmp}/deep.json", "w").write("[" * 100000 + "]" * 100000)
open(f"{tmp}/huge.json", "w").write(text.replace('"lr": 0.003', '"lr": 1e400'))
open(f"{tmp}/nul_key.json", "w").write(text.replace('"model"', '"mo\\u0000del"'))
PY
grep -q 1e400 "$TMP/huge.json" && grep -qF 'mo\u0000del' "$TMP/nul_key.json" || { echo "FAIL: setup"; exit 1; }

for mode in run check; do
  extra=()
  [ "$mode" = check ] && extra=(--check)
  expect "deep-$mode" 1 "deep.json: line 1, column 65: [0][0]" "$TMP/deep.json" "${extra[@]}"
  expect "deep-$mode-limit" 1 "nested deeper than 64 levels" "$TMP/deep.json" "${extra[@]}"
  expect "huge-number-$mode" 1 "huge.json: line 7, column 51: optimizer.params.lr: number 1e400 is out of range" \
    "$TMP/huge.json" "${extra[@]}"
  expect "nul-key-$mode" 1 'mo\u0000del: unknown key (did you mean '"'model'"'?)' "$TMP/nul_key.json" "${extra[@]}"
  expect "set-index-$mode" 1 \
    "optimizer.params.betas.99999999999999999999: index 99999999999999999999 is out of range for a list of 2" \
    "$CFG" --set optimizer.params.betas.99999999999999999999=1 "${extra[@]}"
  expect "set-huge-number-$mode" 1 "optimizer.params.lr: number 1e400 is out of range" \
    "$CFG" --set optimizer.params.lr=1e400 "${extra[@]}"
  expect "set-deep-$mode" 1 "nested deeper than 64 levels" \
    "$CFG" --set "run.x=$(printf '[%.0s' $(seq 1 100))1$(printf ']%.0s' $(seq 1 100))" "${extra[@]}"
done
for bad in -3 abc 1.5 99999999999999999999; do
  expect "steps-$bad" 2 "--steps must be an integer >= 0, got $bad" "$CFG" --steps "$bad"
done
expect "ranks-0" 2 "--ranks must be a positive integer up to 2147483647, got 0" "$CFG" --check --ranks 0

echo "config_cli_test: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
