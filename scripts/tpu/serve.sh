#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Start `jaxserve serve` in the background on the TPU VM and wait until it is SERVING; --stop
# stops it. On a multi-host slice (--multihost) every worker runs it with --distributed auto:
# JAX finds the slice, process 0 serves gRPC on PORT and the others follow its plans. Logs go
# to ~/jaxserve-serve.log on each worker. It installs nothing.
#
#   scripts/tpu/serve.sh --model models/llama-3-8b-hf-jaxserve --tensor-parallel-size 8
#   scripts/tpu/serve.sh --multihost --tensor-parallel-size 16 -- --max-num-seqs 64
#   scripts/tpu/serve.sh --stop
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL="${MODEL:-default}"
TP="${TENSOR_PARALLEL_SIZE:-1}"
MULTIHOST="${MULTIHOST:-0}"
WAIT_SECONDS="${WAIT_SECONDS:-900}"
STOP=0
EXTRA=()

usage() {
  echo "usage: $(basename "$0") [--model SPEC] [--tensor-parallel-size N] [--multihost] [--stop]
                [common flags] [-- extra jaxserve serve flags]
  --model SPEC              a path on the VM (relative: to the home directory), or default
                            (MODEL)
  --tensor-parallel-size N  devices to shard over; with --multihost, every chip of the slice
                            (TENSOR_PARALLEL_SIZE, default: $TP); must divide the KV heads
  --multihost               the slice has several hosts (MULTIHOST=1)
  --wait-seconds S          how long to wait for SERVING (WAIT_SECONDS, default: $WAIT_SECONDS)
  --stop                    stop the server started by this script
$COMMON_USAGE"
}

while (($#)); do
  parse_common_flag "$@"
  if ((SHIFT_BY)); then shift "$SHIFT_BY"; continue; fi
  case "$1" in
    --model) MODEL="${2:?--model needs a value}"; shift 2 ;;
    --tensor-parallel-size) TP="${2:?--tensor-parallel-size needs a value}"; shift 2 ;;
    --multihost) MULTIHOST=1; shift ;;
    --wait-seconds) WAIT_SECONDS="${2:?--wait-seconds needs a value}"; shift 2 ;;
    --stop) STOP=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) usage >&2; die "unknown flag: $1" ;;
  esac
done

WORKERS=0
if [[ "$MULTIHOST" == 1 ]]; then
  WORKERS=all
fi
if [[ "$STOP" == 1 ]]; then
  # shellcheck disable=SC2016  # expanded by the VM's shell
  on_workers "$WORKERS" 'if [ -f ~/jaxserve-serve.pid ]; then kill "$(cat ~/jaxserve-serve.pid)"; rm -f ~/jaxserve-serve.pid; fi'
  exit 0
fi

serve=("$REMOTE_PYTHON" -m jaxserve.entrypoints.cli serve --model "$MODEL" --host 0.0.0.0 --port "$PORT"
       --tensor-parallel-size "$TP")
if [[ "$MULTIHOST" == 1 ]]; then
  serve+=(--distributed auto)
fi
serve+=("${EXTRA[@]}")
line=""
for word in "${serve[@]}"; do
  line+="$(quote_word "$word") "
done
on_workers "$WORKERS" "nohup ${line}> ~/jaxserve-serve.log 2>&1 < /dev/null & echo \$! > ~/jaxserve-serve.pid"

# Poll health on worker 0 (process 0 serves) until SERVING; show the log if it never is.
wait_py="import sys, time
from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError
client, deadline = JaxServeClient(\"127.0.0.1:$PORT\"), time.time() + $WAIT_SECONDS
while time.time() < deadline:
    try:
        if client.health() == \"SERVING\":
            sys.exit(print(\"jaxserve is SERVING on port $PORT\"))
    except JaxServeError:
        pass
    time.sleep(5)
sys.exit(\"jaxserve did not become SERVING in $WAIT_SECONDS s\")"
on_workers 0 "$REMOTE_PYTHON - <<\"PY\" || { tail -n 50 ~/jaxserve-serve.log; exit 1; }
$wait_py
PY"
