#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Put a model on every worker of the TPU VM, under models/ in the home directory (remote
# commands run there, so serve.sh takes the same relative path): copy a local file or directory,
# or fetch one from Cloud Storage; with --convert, turn it into a jaxserve (Orbax) checkpoint
# there (`jaxserve convert`), which `jaxserve serve` restores straight into its shardings.
# "default" (the embedded SmolLM2-135M) needs no copy. It prints, on stderr, the --model value
# for serve.sh. It starts no server.
#
#   scripts/tpu/model.sh --from ./llama-3-8b-hf --convert
#   scripts/tpu/model.sh --from gs://my-bucket/models/llama-3-8b-hf --convert
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

FROM="${MODEL_SOURCE:-default}"
CONVERT="${CONVERT:-0}"

usage() {
  echo "usage: $(basename "$0") --from SOURCE [--convert] [common flags]
  --from SOURCE             a local path, a gs:// URI, or default (MODEL_SOURCE)
  --convert                 write a jaxserve checkpoint models/NAME-jaxserve (CONVERT=1)
$COMMON_USAGE"
}

while (($#)); do
  parse_common_flag "$@"
  if ((SHIFT_BY)); then shift "$SHIFT_BY"; continue; fi
  case "$1" in
    --from) FROM="${2:?--from needs a value}"; shift 2 ;;
    --convert) CONVERT=1; shift ;;
    *) usage >&2; die "unknown flag: $1" ;;
  esac
done

case "$FROM" in
  default) ;;
  gs://*)
    on_workers all "mkdir -p models && gcloud storage cp --recursive $(quote_word "$FROM") models/"
    ;;
  *)
    [[ -e "$FROM" ]] || die "no such file or directory: $FROM"
    on_workers all "mkdir -p models"
    tpu_vm scp --recurse "$FROM" "$TPU_NAME:models/" --worker=all
    ;;
esac

if [[ "$CONVERT" == 1 ]]; then
  on_workers all "$REMOTE_PYTHON -m jaxserve.entrypoints.cli convert $(quote_word "$(vm_model_path "$FROM" 0)") \
$(quote_word "$(vm_model_path "$FROM" 1)")"
fi
echo "model on the VM: --model $(vm_model_path "$FROM" "$CONVERT")" >&2
