#!/usr/bin/env bash
# abort_test.sh REGEX COMMAND...: runs COMMAND, which must end with exit code 7
# (the code passed to Communicator::abort) and print a line matching REGEX.
set -u
regex=$1
shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
echo "abort_test: exit code $rc"
if [ "$rc" -ne 7 ]; then
  echo "abort_test: FAIL: expected exit code 7"
  exit 1
fi
if ! grep -q -- "$regex" <<<"$out"; then
  echo "abort_test: FAIL: no line matches: $regex"
  exit 1
fi
if grep -q "still running after the abort" <<<"$out"; then
  echo "abort_test: FAIL: a rank outlived the abort"
  exit 1
fi
echo "abort_test: ok"
