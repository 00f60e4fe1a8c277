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
#   MEGARL_STOP_TIMEOUT  seconds the driver gets to stop after a stop signal (default 600), then it is
#                     killed (the previous checkpoint stays the latest)
#
# Stopping: Ctrl-C (SIGINT) or SIGTERM to this script asks the driver to finish its step, save a
# checkpoint and exit 75 (the same command resumes); a second one abandons the step, a third kills the
# driver. Ray is stopped only after the driver has exited, and the exit status is the driver's: 0 done,
# 1 a bug, 2 bad input, 3 workers lost, 75 stopped and resumable (launch/README.md).
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
STOP_TIMEOUT="${MEGARL_STOP_TIMEOUT:-600}"
[[ "$STOP_TIMEOUT" =~ ^[0-9]+$ ]] || die "MEGARL_STOP_TIMEOUT must be whole seconds, not '$STOP_TIMEOUT'"
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
export RAY_prestart_worker_first_driver="${RAY_prestart_worker_first_driver:-0}"  # see megarl.sbatch

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

# Stop signals. While the driver runs: the first asks it to finish its step, save and exit (SIGTERM,
# what `megarl train` takes for a graceful stop), the second to abandon the step, a third kills it.
# Before it runs, the script ends (128+N) and the EXIT trap tears down.
STOPS=0
STOP_DEADLINE=""  # SECONDS by which the driver must have exited
on_stop_signal() {  # on_stop_signal NAME
    if [[ -z "$DRIVER_PID" ]]; then exit $((128 + $(kill -l "$1"))); fi
    STOPS=$((STOPS + 1))
    case $STOPS in
        1) STOP_DEADLINE=$((SECONDS + STOP_TIMEOUT))
           log "SIG$1: asking the driver to finish its step, save a checkpoint and exit (waiting up to" \
               "${STOP_TIMEOUT}s before Ray is stopped; again to abandon the step)"
           kill -TERM "$DRIVER_PID" 2>/dev/null || true ;;
        2) log "SIG$1 again: asking the driver to abandon its step (once more kills it)"
           kill -TERM "$DRIVER_PID" 2>/dev/null || true ;;
        *) log "SIG$1 a third time: killing the driver"
           kill -KILL "$DRIVER_PID" 2>/dev/null || true ;;
    esac
}
trap 'on_stop_signal INT' INT
trap 'on_stop_signal TERM' TERM

# What the driver's exit status means (megarl/errors.py), for the log.
describe_exit() {
    case $1 in
        0) echo "finished" ;;
        1) echo "a bug: see the traceback above" ;;
        2) echo "bad input (config, data, checkpoint, a locked output directory): fix it, then run again" ;;
        3) echo "workers lost and not restartable: run the same command again to resume from the newest checkpoint" ;;
        75) echo "stopped by a signal: run the same command again to resume" ;;
        *) echo "killed by a signal" ;;
    esac
}

# Ray and the driver each get their own session (setsid): Ctrl-C in a terminal signals the whole
# foreground process group, and the driver would take it plus the SIGTERM forwarded here for two
# signals (abandon the step); Ray must outlive the driver's checkpoint.
SETSID=()
if command -v setsid >/dev/null; then SETSID=(setsid); fi

log "Ray head: $CPUS_PER_NODE CPUs, $GPUS_PER_NODE GPUs, port $RAY_PORT, logs in $RAY_TMPDIR"
"${SETSID[@]}" "$PYTHON" -m ray.scripts.scripts start --head --block --disable-usage-stats --temp-dir="$RAY_TMPDIR" \
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

# In the background and waited for, so that a signal reaches its trap at once; after a stop signal the
# wait is bounded (MEGARL_STOP_TIMEOUT), and Ray is stopped only once the driver has exited.
DRIVER="${MEGARL_DRIVER:--m megarl.train}"
log "running: $PYTHON $DRIVER $CONFIG $* (Ray at $RAY_ADDRESS)"
# shellcheck disable=SC2086  # DRIVER is "-m module" or a script path: split on purpose
"${SETSID[@]}" "$PYTHON" $DRIVER "$CONFIG" "$@" &
DRIVER_PID=$!  # setsid execs in place (a child here is no process group leader): this is the driver
while kill -0 "$DRIVER_PID" 2>/dev/null; do
    if [[ -z "$STOP_DEADLINE" ]]; then
        wait "$DRIVER_PID" || true  # returns early (>128) when a trapped signal arrives
    elif ((SECONDS < STOP_DEADLINE)); then
        sleep 1
    else
        log "the driver did not exit within ${STOP_TIMEOUT}s (MEGARL_STOP_TIMEOUT) of the stop signal: killing it"
        kill -KILL "$DRIVER_PID" 2>/dev/null || true
    fi
done
rc=0
wait "$DRIVER_PID" || rc=$?
DRIVER_PID=""
log "the driver exited with status $rc: $(describe_exit "$rc")"
exit "$rc"
