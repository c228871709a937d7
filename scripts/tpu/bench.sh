#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Run `jaxserve bench serve` on worker 0 of the TPU VM against the server serve.sh started,
# and copy its JSON report back. Flags after `--` go to `jaxserve bench serve`. It starts no
# server and creates no VM.
#
#   scripts/tpu/bench.sh --out results/ -- --num-prompts 256 --max-concurrency 64
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

OUT="${BENCH_OUT:-tpu-bench-results}"
EXTRA=()

usage() {
  echo "usage: $(basename "$0") [--out DIR] [common flags] [-- jaxserve bench serve flags]
  --out DIR                 local directory for the JSON report (BENCH_OUT, default: $OUT)
$COMMON_USAGE"
}

while (($#)); do
  parse_common_flag "$@"
  if ((SHIFT_BY)); then shift "$SHIFT_BY"; continue; fi
  case "$1" in
    --out) OUT="${2:?--out needs a value}"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) usage >&2; die "unknown flag: $1" ;;
  esac
done

REPORT="jaxserve-bench-$ACCELERATOR_TYPE.json"
bench="$REMOTE_PYTHON -m jaxserve.entrypoints.cli bench serve --address 127.0.0.1:$PORT --json ~/$REPORT"
for word in "${EXTRA[@]}"; do
  bench+=" $(quote_word "$word")"
done
on_workers 0 "$bench"
run mkdir -p "$OUT"
tpu_vm scp "$TPU_NAME:$REPORT" "$OUT/" --worker=0
