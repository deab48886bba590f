#!/usr/bin/env bash
# The real ds_configs in tests/configs/real/ (sources in its README) do what
# its expect.json says, with zinc's experiment sections added by --set:
#   "train": --check accepts it at 1 and 2 ranks, and it trains 2 steps on 1
#            and on 2 ranks, saying where each "auto" value came from;
#   "refuse": training ends with one error line "KEY: ...REASON..." and exit
#            1, and --check refuses it with that line at 1 and 2 ranks.
# A "train" entry may name, under "refuse_at", a world size at which it is
# refused instead (a batch triad written for one rank): there --check and
# training both refuse it with that key and reason.
# An entry may add "sets" (PATH=VALUE strings, passed as --set after the
# experiment sections), e.g. to cut a 65536 batch that would cost CI minutes;
# its note says why.
# Every config in the folder must have an entry (and every entry a file),
# and a row in the folder's README table (at least 40 sources).
# DeepSpeed's own verdicts (deepspeed_accepts.json, written by
# deepspeed_accepts.py; read here, so no torch is needed): where DeepSpeed
# accepts a config at a world size, zinc must train it there, or refuse it
# with a reason naming a feature that changes training (expect.json's
# _deepspeed_accepts_refusals_allowed lists them).
# Usage: real_configs_test.sh ZINC_TRAIN REPO_ROOT
set -u
ZT="$1"
ROOT="$2"
DIR="$ROOT/tests/configs/real"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
MPIRUN=(mpirun --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
[ "$(id -u)" -eq 0 ] && MPIRUN+=(--allow-run-as-root)
SETS=(--set 'model={"type":"gpt","n_layer":2,"n_head":4,"n_embd":64}'
      --set 'data={"type":"synthetic","vocab_size":32,"seq_len":32}'
      --set run.steps=2 --set 'trainer={}')
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }

# The manifest and the folder list the same files.
python3 - "$DIR" <<'PY' || bad "expect.json and the folder disagree"
import json, os, sys
d = sys.argv[1]
m = {k: v for k, v in json.load(open(os.path.join(d, "expect.json"))).items() if not k.startswith("_")}
files = {f for f in os.listdir(d) if f.endswith(".json") and f not in ("expect.json", "deepspeed_accepts.json")}
assert set(m) == files, (sorted(set(m) ^ files))
for k, v in m.items():
    assert v["expect"] in ("train", "refuse") and (v["expect"] == "train" or v["key"] and v["reason"]), (k, v)
PY

# The README's table names exactly the configs present, at least 40 sources.
python3 - "$DIR" <<'PY' || bad "README.md's source table and the folder disagree"
import os, re, sys
d = sys.argv[1]
rows = re.findall(r"^\| `([^`]+\.json)` \| (.+) \|$", open(os.path.join(d, "README.md")).read(), re.M)
named = [r[0] for r in rows]
files = {f for f in os.listdir(d) if f.endswith(".json") and f not in ("expect.json", "deepspeed_accepts.json")}
ok = True
for f in sorted(set(named) ^ files):
    print("FAIL %s: %s" % (f, "in README.md's table, no such file" if f in named else "no row in README.md's table"))
    ok = False
for f in sorted({f for f in named if named.count(f) > 1}):
    print("FAIL %s: more than one row in README.md's table" % f)
    ok = False
for f, src in rows:
    if not re.search(r"^\S+/\S+, `[^`]+` \(commit [0-9a-f]{7,40}", src):
        print("FAIL %s: its row does not give repository, `path` (commit ...)" % f)
        ok = False
if len(files) < 40:
    print("FAIL %d sources, want at least 40" % len(files))
    ok = False
sys.exit(0 if ok else 1)
PY

# Where DeepSpeed accepts a config, zinc trains it or refuses it for a
# feature that changes training; one line per offending config.
python3 - "$DIR" <<'PY' || bad "expect.json refuses configs DeepSpeed accepts, for no feature that changes training"
import json, os, sys
d = sys.argv[1]
m = json.load(open(os.path.join(d, "expect.json")))
allowed = {k: v for k, v in m["_deepspeed_accepts_refusals_allowed"].items() if not k.startswith("_")}
ds = json.load(open(os.path.join(d, "deepspeed_accepts.json")))
ok = True
for name, e in sorted(m.items()):
    if name.startswith("_"):
        continue
    if name not in ds:
        print("FAIL %s: no DeepSpeed verdict in deepspeed_accepts.json (rerun deepspeed_accepts.py)" % name)
        ok = False
        continue
    for ws in ("1", "2"):
        if ds[name][ws]["verdict"] != "accepted":
            continue
        if e["expect"] == "refuse":
            key, reason = e["key"], e["reason"]
        elif ws in e.get("refuse_at", {}):
            key, reason = e["refuse_at"][ws]["key"], e["refuse_at"][ws]["reason"]
        else:
            continue
        if not any(w.lower() in reason.lower() for ws_ in allowed.values() for w in ws_):
            print("FAIL %s: DeepSpeed accepts it at %s rank(s) (triad %s) but expect.json refuses '%s' (\"%s\"), not a feature that changes training"
                  % (name, ws, ds[name][ws]["triad"], key, reason))
            ok = False
for name in sorted(set(ds) - set(m)):
    if not name.startswith("_"):
        print("FAIL %s: in deepspeed_accepts.json, not in expect.json" % name)
        ok = False
sys.exit(0 if ok else 1)
PY

expect() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]].get(sys.argv[3], ""))' \
             "$DIR/expect.json" "$1" "$2"; }
for cfg in "$DIR"/*.json; do
  name="$(basename "$cfg")"
  [ "$name" = expect.json ] || [ "$name" = deepspeed_accepts.json ] && continue
  want="$(expect "$name" expect)"
  # An entry's "sets" (a list of PATH=VALUE) go in after SETS: a batch so
  # large that two steps would cost CI minutes is cut there, with the reason
  # in the entry's note; everything else stays as the file has it.
  ESETS=()
  while IFS= read -r kv; do [ -n "$kv" ] && ESETS+=(--set "$kv"); done < <(
    python3 -c 'import json,sys; [print(x) for x in json.load(open(sys.argv[1]))[sys.argv[2]].get("sets", [])]' \
      "$DIR/expect.json" "$name")
  if [ "$want" = train ]; then
    for np in 1 2; do
      # A batch triad written for one world size is refused at another, as
      # DeepSpeed refuses it: "refuse_at": {"2": {"key": ..., "reason": ...}}.
      rkey="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]].get("refuse_at", {}).get(sys.argv[3], {}).get("key", ""))' "$DIR/expect.json" "$name" "$np")"
      if [ -n "$rkey" ]; then
        rreason="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]]["refuse_at"][sys.argv[3]]["reason"])' "$DIR/expect.json" "$name" "$np")"
        OMP_NUM_THREADS=1 "$ZT" "$cfg" "${SETS[@]}" ${ESETS[@]+"${ESETS[@]}"} --check --ranks "$np" >"$TMP/check" 2>"$TMP/err"
        rc=$?
        if [ "$rc" -eq 1 ] && grep -qF -- "refused: $rkey: " "$TMP/check" && grep '^refused' "$TMP/check" | grep -qF -- "$rreason"; then
          ok
        else
          bad "$name: --check at $np rank(s) should refuse '$rkey', rc=$rc"; tail -3 "$TMP/check"
        fi
        if [ "$np" -eq 1 ]; then cmd=("$ZT"); else cmd=("${MPIRUN[@]}" "$ZT"); fi
        if ! OMP_NUM_THREADS=1 "${cmd[@]}" "$cfg" "${SETS[@]}" ${ESETS[@]+"${ESETS[@]}"} >"$TMP/out" 2>"$TMP/err" &&
           grep -F -- " $rkey: " "$TMP/err" | grep -qF -- "$rreason" && ! grep -q '^step' "$TMP/out"; then
          ok
        else
          bad "$name: training at $np rank(s) should refuse '$rkey'"; tail -3 "$TMP/err"
        fi
        continue
      fi
      if OMP_NUM_THREADS=1 "$ZT" "$cfg" "${SETS[@]}" ${ESETS[@]+"${ESETS[@]}"} --check --ranks "$np" >"$TMP/check" 2>"$TMP/err" &&
         grep -q '^ok: the run would start' "$TMP/check"; then ok; else bad "$name: --check at $np rank(s)"; cat "$TMP/check" "$TMP/err" | tail -5; fi
      if [ "$np" -eq 1 ]; then cmd=("$ZT"); else cmd=("${MPIRUN[@]}" "$ZT"); fi
      if OMP_NUM_THREADS=1 "${cmd[@]}" "$cfg" "${SETS[@]}" ${ESETS[@]+"${ESETS[@]}"} --json >"$TMP/out" 2>"$TMP/err" &&
         python3 - "$TMP/out" "$np" <<'PY'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
np = int(sys.argv[2])
steps = [e for e in events if e["event"] == "step"]
assert steps and steps[-1]["step"] == 2, events
s = events[-1]
assert s["event"] == "summary" and s["world_size"] == np and s["final_loss"] > 0, s
auto = [e for e in events if e["event"] == "auto"]
assert len(auto) <= 1 and all(v["source"] for a in auto for v in a["values"]), auto
cfg = [e for e in events if e["event"] == "config"]
assert len(cfg) == 1 and cfg[0]["world_size"] == np, cfg
PY
      then ok; else bad "$name: training on $np rank(s)"; tail -5 "$TMP/out"; tail -5 "$TMP/err"; fi
    done
  else
    key="$(expect "$name" key)"
    reason="$(expect "$name" reason)"
    OMP_NUM_THREADS=1 "$ZT" "$cfg" "${SETS[@]}" ${ESETS[@]+"${ESETS[@]}"} >"$TMP/out" 2>"$TMP/err"
    rc=$?
    line="$(grep -v '^zinc\[' "$TMP/err")"
    if [ "$rc" -eq 1 ] && [ "$(grep -vc '^zinc\[' "$TMP/err")" -eq 1 ] &&
       grep -qF -- "error: $key: " <<<"$line" && grep -qF -- "$reason" <<<"$line" && ! grep -q '^step' "$TMP/out"; then
      ok
    else
      bad "$name: want a refusal naming '$key' with '$reason', rc=$rc: $line"
    fi
    for np in 1 2; do
      OMP_NUM_THREADS=1 "$ZT" "$cfg" "${SETS[@]}" ${ESETS[@]+"${ESETS[@]}"} --check --ranks "$np" >"$TMP/check" 2>"$TMP/err"
      rc=$?
      if [ "$rc" -eq 1 ] && grep -qF -- "refused: $key: " "$TMP/check" && grep '^refused' "$TMP/check" | grep -qF -- "$reason"; then
        ok
      else
        bad "$name: --check at $np rank(s) rc=$rc"; cat "$TMP/check" | tail -3
      fi
    done
  fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
