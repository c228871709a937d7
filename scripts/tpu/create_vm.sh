#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Create a Cloud TPU VM (one host or a multi-host slice) for jaxserve. It only creates the VM:
# install.sh installs, delete_vm.sh deletes.
#
#   scripts/tpu/create_vm.sh --name my-tpu --zone us-west4-a --accelerator-type v5litepod-8
#   scripts/tpu/create_vm.sh --spot --dry-run
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SPOT="${SPOT:-0}"

usage() {
  echo "usage: $(basename "$0") [--spot] [common flags]
  --spot                    a Spot VM (cheaper, may be preempted; SPOT=1)
$COMMON_USAGE"
}

while (($#)); do
  parse_common_flag "$@"
  if ((SHIFT_BY)); then shift "$SHIFT_BY"; continue; fi
  case "$1" in
    --spot) SPOT=1; shift ;;
    *) usage >&2; die "unknown flag: $1" ;;
  esac
done

args=("$TPU_NAME" "--accelerator-type=$ACCELERATOR_TYPE" "--version=$RUNTIME_VERSION")
if [[ "$SPOT" == 1 ]]; then
  args+=(--spot)
fi
tpu_vm create "${args[@]}"
