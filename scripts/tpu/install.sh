#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Install JAX's TPU wheels and jaxserve on every worker of the TPU VM: from this checkout
# (`git archive HEAD`, so committed code only; the default) or from a git URL. It installs
# only; it creates and starts nothing.
#
#   scripts/tpu/install.sh --name my-tpu
#   scripts/tpu/install.sh --source git --git-url https://github.com/ORG/jaxserve.git --git-ref v0.1.0
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SOURCE="${JAXSERVE_SOURCE:-local}"
GIT_URL="${JAXSERVE_GIT_URL:-}"
GIT_REF="${JAXSERVE_GIT_REF:-main}"
JAX_SPEC="${JAX_SPEC:-jax[tpu]}"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TARBALL="${TMPDIR:-/tmp}/jaxserve-src.tar.gz"

usage() {
  echo "usage: $(basename "$0") [--source local|git] [--git-url URL] [--git-ref REF] [common flags]
  --source local|git        this checkout's HEAD (default) or a git URL (JAXSERVE_SOURCE)
  --git-url URL             with --source git (JAXSERVE_GIT_URL)
  --git-ref REF             branch, tag or commit (JAXSERVE_GIT_REF, default: $GIT_REF)
  --jax-spec SPEC           pip requirement for JAX on TPU (JAX_SPEC, default: $JAX_SPEC)
$COMMON_USAGE"
}

while (($#)); do
  parse_common_flag "$@"
  if ((SHIFT_BY)); then shift "$SHIFT_BY"; continue; fi
  case "$1" in
    --source) SOURCE="${2:?--source needs a value}"; shift 2 ;;
    --git-url) GIT_URL="${2:?--git-url needs a value}"; shift 2 ;;
    --git-ref) GIT_REF="${2:?--git-ref needs a value}"; shift 2 ;;
    --jax-spec) JAX_SPEC="${2:?--jax-spec needs a value}"; shift 2 ;;
    *) usage >&2; die "unknown flag: $1" ;;
  esac
done

PIP="$REMOTE_PYTHON -m pip install --upgrade"
JAX_STEP="$PIP $(quote_word "$JAX_SPEC")"
CHECK_STEP="$REMOTE_PYTHON -c 'import jax, jaxserve; print(jax.local_devices())'"
case "$SOURCE" in
  local)
    run git -C "$REPO_DIR" archive --format=tar.gz "--output=$TARBALL" HEAD
    tpu_vm scp "$TARBALL" "$TPU_NAME:jaxserve-src.tar.gz" --worker=all
    on_workers all "rm -rf ~/jaxserve && mkdir -p ~/jaxserve && \
tar -xzf ~/jaxserve-src.tar.gz -C ~/jaxserve && $JAX_STEP && $PIP ~/jaxserve && $CHECK_STEP"
    ;;
  git)
    [[ -n "$GIT_URL" ]] || die "--source git needs --git-url"
    on_workers all "$JAX_STEP && $PIP $(quote_word "jaxserve @ git+$GIT_URL@$GIT_REF") && \
$CHECK_STEP"
    ;;
  *) die "--source must be local or git, got $SOURCE" ;;
esac
