#!/usr/bin/env bash
# The plans a planner change moves, before it is measured: each case of a bench/cases.yaml group (default
# "planner") resolved as the benchmark resolves it (slideformer bench --plan-on), on the H200 machine's GPU
# and RAM, under COMMIT's src (with this tree's harness) and under this tree; prints the cases whose plan
# differs. Runs on any machine, in about 12 s a case.
# Usage: bench/compare_plans.sh COMMIT [name | case ...]   (MACHINE=GPU_GIB,RAM_GIB to plan for another)
set -uo pipefail
old=${1:?usage: bench/compare_plans.sh COMMIT [name | case ...]}; shift
machine=${MACHINE:-139.8,125.8}
# the repo's environment where `make setup` made one (a python3 without torch plans nothing)
py=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
src=$(mktemp -d); trap 'rm -rf "$src"' EXIT
git archive "$old" src | tar -x -C "$src" || exit 2
cp src/slideformer/bench/harness.py "$src/src/slideformer/bench/harness.py"  # (this tree's --plan-on, COMMIT's planner)
if [[ $# -le 1 ]]; then
  mapfile -t named < <("$py" - "${1:-planner}" <<'PY'
import sys, yaml
cases = yaml.safe_load(open("bench/cases.yaml"))
print("\n".join(cases[sys.argv[1]]["cases"]) if sys.argv[1] in cases else sys.argv[1])
PY
)
  set -- "${named[@]}"
fi
plan() {  # one line: the plan's fields, without the command
  read -r sys model b extra <<<"$2"
  PYTHONPATH=$1 "$py" -m slideformer.bench --system "$sys" --model "$model" --batch "$b" $extra --plan-on "$machine" \
    2>&1 | tail -1 | "$py" -c "import json, sys; r = json.loads(sys.stdin.read()); r.pop('command'); print(json.dumps(r))" \
    2>/dev/null || echo "(no plan)"
}
changed=0 failed=0
for c in "$@"; do
  a=$(plan "$src/src" "$c"); b=$(plan "$PWD/src" "$c")
  [[ $b == "(no plan)" ]] && failed=$((failed + 1))
  if [[ $a != "$b" ]]; then
    changed=$((changed + 1)); printf '== %s\n  %s: %s\n  this tree: %s\n' "$c" "$old" "$a" "$b"
  fi
done
echo "$changed of $# plans changed"
# (a case whose refusal is its plan prints a problem, not "(no plan)": this is a planner that did not run)
[[ $failed -eq 0 ]] || { echo "$failed of $# cases planned nothing under this tree (PYTHON=$py): see the command's error"; exit 1; }
