#!/bin/bash
# megarl on one machine: a private Ray head with declared resources, `megarl train` on it, and that
# Ray (only that one) stopped on every exit path.
#
#   launch/local.sh CONFIG.yaml [key.path=value ...]
#   GPUS_PER_NODE=8 launch/local.sh examples/.../config.yaml trainer.total_steps=10
#
# Without a launcher, `megarl train` starts a throwaway Ray itself (ray.init() guesses the resources);
# this script is for when the resources must be stated, or the Ray cluster should outlive the
# driver's imports (logs, a dashboard).
#
# Environment (all optional):
#   MEGARL_CONFIG     the YAML config; when unset, the first argument is the config
#   GPUS_PER_NODE     GPUs Ray may use (default: the GPUs `nvidia-smi -L` lists, else 0)
#   CPUS_PER_NODE     CPUs Ray may use (default: nproc)
#   RAY_PORT          the head's GCS port (default 6379); RAY_PORT+1 and +2 are taken too
#   RAY_DASHBOARD     1 to start the Ray dashboard (default 0); RAY_DASHBOARD_PORT (8265)
#   RAY_START_ARGS    extra `ray start` flags, e.g. "--object-store-memory=1000000000"
#   RAY_TMPDIR        Ray's temp/session dir (default: a fresh /tmp/megarl_ray_XXXXXX); Ray's logs
#   VENV, PYTHON      a virtualenv put first on PATH; the interpreter (default python3)
#   MEGARL_DRIVER     what runs with CONFIG and the arguments (default "-m megarl.train");
#                     "tools/benchmark.py" benchmarks the config instead (its flags go after CONFIG)
# Ray 2.60 enables token authentication by default (token in ~/.ray/auth_token, shared by the head
# and the driver here); RAY_AUTH_MODE=disabled turns it off, e.g. for tests on a private machine.

set -euo pipefail

log() { echo "[megarl.local $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if [[ -n "${MEGARL_CONFIG:-}" ]]; then
    CONFIG="$MEGARL_CONFIG"
else
    [[ $# -ge 1 ]] || die "usage: $0 CONFIG.yaml [key.path=value ...] (or set MEGARL_CONFIG)"
    CONFIG="$1"
    shift
fi
if [[ -n "${VENV:-}" ]]; then export PATH="$VENV/bin:$PATH"; fi
PYTHON="${PYTHON:-python3}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
fi
CPUS_PER_NODE="${CPUS_PER_NODE:-$(nproc)}"
RAY_PORT="${RAY_PORT:-6379}"
RAY_TMPDIR="${RAY_TMPDIR:-$(mktemp -d /tmp/megarl_ray_XXXXXX)}"
mkdir -p "$RAY_TMPDIR"
read -r -a EXTRA_RAY_ARGS <<< "${RAY_START_ARGS:-}"
if [[ "${RAY_DASHBOARD:-0}" == 1 || "${RAY_DASHBOARD:-0}" == true ]]; then
    DASHBOARD_ARGS=(--include-dashboard=true --dashboard-port="${RAY_DASHBOARD_PORT:-8265}")
else
    DASHBOARD_ARGS=(--include-dashboard=false)
fi
export RAY_USAGE_STATS_ENABLED=0
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"  # see megarl.sbatch

# Teardown. Not `ray stop`: it kills every Ray process on the machine, other users' clusters
# included. SIGTERM to our `ray start --block` stops exactly the processes it started.
RAY_PID=""
DRIVER_PID=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$DRIVER_PID" ]]; then kill -TERM "$DRIVER_PID" 2>/dev/null || true; fi
    if [[ -n "$RAY_PID" ]]; then
        log "stopping Ray (exit status $rc)"
        kill -TERM "$RAY_PID" 2>/dev/null || true
        local _
        for _ in $(seq 20); do kill -0 "$RAY_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL "$RAY_PID" 2>/dev/null || true  # its reaper then kills what is left
    fi
    wait 2>/dev/null || true
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "Ray head: $CPUS_PER_NODE CPUs, $GPUS_PER_NODE GPUs, port $RAY_PORT, logs in $RAY_TMPDIR"
"$PYTHON" -m ray.scripts.scripts start --head --block --disable-usage-stats --temp-dir="$RAY_TMPDIR" \
    --port="$RAY_PORT" --ray-client-server-port=$((RAY_PORT + 1)) \
    --dashboard-agent-listen-port=$((RAY_PORT + 2)) "${DASHBOARD_ARGS[@]}" \
    --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" "${EXTRA_RAY_ARGS[@]}" \
    > "$RAY_TMPDIR/ray-head.log" 2>&1 &
RAY_PID=$!

# `ray start` writes the cluster's address into its temp dir once the head is up.
ADDRESS_FILE="$RAY_TMPDIR/ray_current_cluster"
for _ in $(seq 120); do
    [[ -s "$ADDRESS_FILE" ]] && break
    if ! kill -0 "$RAY_PID" 2>/dev/null; then
        tail -n 30 "$RAY_TMPDIR/ray-head.log" >&2 || true
        die "the Ray head exited before it came up (log above: $RAY_TMPDIR/ray-head.log)"
    fi
    sleep 1
done
[[ -s "$ADDRESS_FILE" ]] || die "the Ray head did not come up within 120 s; see $RAY_TMPDIR/ray-head.log"
RAY_ADDRESS="$(cat "$ADDRESS_FILE")"
export RAY_ADDRESS

# In the background and waited for, so that Ctrl-C / SIGTERM reach the trap at once.
DRIVER="${MEGARL_DRIVER:--m megarl.train}"
log "running: $PYTHON $DRIVER $CONFIG $* (Ray at $RAY_ADDRESS)"
# shellcheck disable=SC2086  # DRIVER is "-m module" or a script path: split on purpose
"$PYTHON" $DRIVER "$CONFIG" "$@" &
DRIVER_PID=$!
rc=0
wait "$DRIVER_PID" || rc=$?
DRIVER_PID=""
log "the driver exited with status $rc"
exit "$rc"
