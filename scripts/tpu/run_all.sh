#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# End to end on a fresh Cloud TPU VM: create it, install JAX TPU wheels and jaxserve, put the
# model there, start `jaxserve serve`, run `jaxserve bench serve` against it, copy the report
# back, and delete the VM (also on failure, unless --keep). Each step is one of the scripts
# next to this one; this script only sequences them.
#
#   scripts/tpu/run_all.sh --name my-tpu --accelerator-type v5litepod-8 --dry-run
#   scripts/tpu/run_all.sh --from ./llama-3-8b-hf --convert --tensor-parallel-size 8 \
#       -- --num-prompts 256 --max-concurrency 64
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

KEEP="${KEEP:-0}"
FROM="${MODEL_SOURCE:-default}"
CONVERT="${CONVERT:-0}"
SPOT_FLAG=()
INSTALL_FLAGS=()
SERVE_FLAGS=()
SERVE_EXTRA=()
BENCH_FLAGS=()
BENCH_EXTRA=()

usage() {
  echo "usage: $(basename "$0") [flags] [common flags] [-- jaxserve bench serve flags]
  --spot                    create a Spot VM
  --keep                    do not delete the VM at the end (KEEP=1)
  --source, --git-url, --git-ref, --jax-spec      as install.sh
  --from SOURCE, --convert                         as model.sh (default model: default)
  --tensor-parallel-size N, --multihost, --wait-seconds S, --serve-arg FLAG
                                                   as serve.sh (--serve-arg once per word)
  --out DIR                                        as bench.sh
$COMMON_USAGE"
}

while (($#)); do
  parse_common_flag "$@"
  if ((SHIFT_BY)); then shift "$SHIFT_BY"; continue; fi
  case "$1" in
    --spot) SPOT_FLAG=(--spot); shift ;;
    --keep) KEEP=1; shift ;;
    --source|--git-url|--git-ref|--jax-spec) INSTALL_FLAGS+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    --from) FROM="${2:?--from needs a value}"; shift 2 ;;
    --convert) CONVERT=1; shift ;;
    --tensor-parallel-size|--wait-seconds) SERVE_FLAGS+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    --multihost) SERVE_FLAGS+=("$1"); shift ;;
    --serve-arg) SERVE_EXTRA+=("${2:?$1 needs a value}"); shift 2 ;;
    --out) BENCH_FLAGS+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    --) shift; BENCH_EXTRA=("$@"); break ;;
    *) usage >&2; die "unknown flag: $1" ;;
  esac
done

export TPU_NAME ZONE PROJECT ACCELERATOR_TYPE RUNTIME_VERSION PORT DRY_RUN REMOTE_PYTHON

"$HERE/create_vm.sh" "${SPOT_FLAG[@]}"
if [[ "$KEEP" != 1 ]]; then
  trap '"$HERE/delete_vm.sh"' EXIT
fi
"$HERE/install.sh" "${INSTALL_FLAGS[@]}"
MODEL_FLAGS=(--from "$FROM")
if [[ "$CONVERT" == 1 ]]; then
  MODEL_FLAGS+=(--convert)
fi
"$HERE/model.sh" "${MODEL_FLAGS[@]}"
MODEL_SPEC="$(vm_model_path "$FROM" "$CONVERT")"
"$HERE/serve.sh" --model "$MODEL_SPEC" "${SERVE_FLAGS[@]}" -- "${SERVE_EXTRA[@]}"
"$HERE/bench.sh" "${BENCH_FLAGS[@]}" -- "${BENCH_EXTRA[@]}"
