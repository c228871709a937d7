# shellcheck shell=bash
# Shared by the scripts in scripts/tpu/: settings (flag > environment > default), flag parsing,
# and `run`, which executes a command or, with --dry-run, prints it (quoted so it can be pasted
# back into a shell) and runs nothing. Sourced only; it never calls gcloud by itself.

set -euo pipefail

TPU_NAME="${TPU_NAME:-jaxserve-tpu}"
ZONE="${ZONE:-us-west4-a}"
PROJECT="${PROJECT:-}"                           # empty: gcloud's configured project
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v5litepod-8}"
RUNTIME_VERSION="${RUNTIME_VERSION:-v2-alpha-tpuv5-lite}"
PORT="${PORT:-50051}"
DRY_RUN="${DRY_RUN:-0}"
REMOTE_PYTHON="${REMOTE_PYTHON:-python3}"

# shellcheck disable=SC2034  # read by the scripts that source this file
COMMON_USAGE="common flags (or environment variables):
  --name NAME               TPU VM name (TPU_NAME, default: $TPU_NAME)
  --zone ZONE               (ZONE, default: $ZONE)
  --project PROJECT         (PROJECT, default: gcloud's configured project)
  --accelerator-type TYPE   (ACCELERATOR_TYPE, default: $ACCELERATOR_TYPE)
  --version RUNTIME         TPU VM runtime (RUNTIME_VERSION, default: $RUNTIME_VERSION)
  --port PORT               jaxserve gRPC port on the VM (PORT, default: $PORT)
  --dry-run                 print the commands instead of running them (DRY_RUN=1)
  -h, --help"

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# Parse one common flag at "$@"; sets SHIFT_BY to the number of words it used (0: not ours).
# shellcheck disable=SC2034  # SHIFT_BY is read by the caller
parse_common_flag() {
  SHIFT_BY=2
  case "$1" in
    --name) TPU_NAME="${2:?--name needs a value}" ;;
    --zone) ZONE="${2:?--zone needs a value}" ;;
    --project) PROJECT="${2:?--project needs a value}" ;;
    --accelerator-type) ACCELERATOR_TYPE="${2:?--accelerator-type needs a value}" ;;
    --version) RUNTIME_VERSION="${2:?--version needs a value}" ;;
    --port) PORT="${2:?--port needs a value}" ;;
    --dry-run) DRY_RUN=1; SHIFT_BY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) SHIFT_BY=0 ;;
  esac
}

# One word, quoted only when the shell needs it.
quote_word() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  elif [[ "$1" != *"'"* ]]; then
    printf "'%s'" "$1"
  elif [[ ! "$1" =~ [\$\`\"\\!] ]]; then
    printf '"%s"' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Run a command, or print it under --dry-run.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    local word line=""
    for word in "$@"; do
      line+="$(quote_word "$word") "
    done
    echo "${line% }"
  else
    "$@"
  fi
}

# gcloud compute tpus tpu-vm SUBCOMMAND ... with this VM's zone and project.
tpu_vm() {
  local sub="$1"
  shift
  local args=(gcloud compute tpus tpu-vm "$sub" "$@" "--zone=$ZONE")
  if [[ -n "$PROJECT" ]]; then
    args+=("--project=$PROJECT")
  fi
  run "${args[@]}"
}

# Run a shell command on the VM's workers ("all", or a worker number).
on_workers() {
  local workers="$1" command="$2"
  tpu_vm ssh "$TPU_NAME" "--worker=$workers" "--command=$command"
}

# Where model.sh puts FROM on the VM (relative to the home directory), after --convert when
# the second argument is 1: the --model value for serve.sh.
vm_model_path() {
  local from="$1" convert="$2" name
  name="$(basename "${from%/}")"
  if [[ "$convert" == 1 ]]; then
    echo "models/$name-jaxserve"
  elif [[ "$from" == default ]]; then
    echo default
  else
    echo "models/$name"
  fi
}
