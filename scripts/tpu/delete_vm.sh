#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Delete the Cloud TPU VM (no prompt). Deleting stops billing; everything on its disks is lost.
#
#   scripts/tpu/delete_vm.sh --name my-tpu --zone us-west4-a
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  echo "usage: $(basename "$0") [common flags]
$COMMON_USAGE"
}

while (($#)); do
  parse_common_flag "$@"
  if ((SHIFT_BY)); then shift "$SHIFT_BY"; continue; fi
  usage >&2
  die "unknown flag: $1"
done

tpu_vm delete "$TPU_NAME" --quiet
