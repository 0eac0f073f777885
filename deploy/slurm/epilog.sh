#!/bin/bash
# Slurm Epilog for wattwatch: ends the record prolog.sh started for the job on this node's agent (see
# prolog.sh for slurm.conf). Jobs the prolog did not start are left to the agent, which ends a discovered
# job when its processes are gone.
# An Epilog that fails drains the node, so this script always exits 0 and only logs what went wrong.

set -u
# Whatever goes wrong, even a bug here, must not take the node down.
trap 'exit 0' EXIT
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

AGENT_HOME="${WATTWATCH_HOME:-/var/lib/wattwatch}"
STATE_DIR="${WATTWATCH_SLURM_STATE:-/run/wattwatch-slurm}"

# To syslog, and to stderr (slurmd logs a failing script's output; tests read it).
log() {
    printf 'wattwatch-epilog: %s\n' "$*" >&2
    logger -t wattwatch-epilog -p daemon.warning -- "$*" 2>/dev/null || true
}

job_id="${SLURM_JOB_ID:-}"
if [[ ! "$job_id" =~ ^[0-9]+$ || ! -e "$STATE_DIR/$job_id" ]]; then
    exit 0  # not started by the prolog
fi
rm -f -- "$STATE_DIR/$job_id"

socket="$AGENT_HOME/agent.sock"
if [[ ! -S "$socket" ]] || ! command -v socat >/dev/null; then
    log "job $job_id: cannot reach the wattwatch agent at $socket (socket or socat missing)"
    exit 0
fi
reply=$(printf '%s\n' "{\"op\": \"job_end\", \"id\": \"slurm-$job_id\"}" | timeout 5 socat -t 3 - "UNIX-CONNECT:$socket" 2>&1)
if [[ "$reply" != *'"ok": true'* ]]; then
    log "job $job_id: the wattwatch agent did not end the job: ${reply:-no answer}"
fi
exit 0
