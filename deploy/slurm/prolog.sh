#!/bin/bash
# Slurm Prolog for wattwatch: starts a record for the job on this node's agent, so the job carries its
# kind and labels from its allocation on. slurm.conf (every GPU node):
#
#   Prolog=/etc/slurm/wattwatch-prolog.sh
#   Epilog=/etc/slurm/wattwatch-epilog.sh
#   PrologFlags=Alloc          # run at allocation, not at the first step
#
# Users choose the kind (training, inference, other) and add labels in the job's comment:
#
#   sbatch --comment 'wattwatch.kind=training wattwatch.label.team=nlp' train.sh
#
# or the operator maps partitions to kinds in PARTITION_KINDS below. The record has the id the agent gives
# the job when it discovers it (slurm-<job id>), so the job's processes join it; the record's kind, name and
# labels win over discovery's guesses. With no kind known, the prolog starts nothing and the agent discovers
# the job by itself (from SLURM_JOB_ID and the job's cgroup), as it always does.
#
# It talks to the agent's socket ($WATTWATCH_HOME/agent.sock, one JSON request per line) with socat.
# A Prolog that fails drains the node, so this script always exits 0 and only logs what went wrong.

set -u
# Whatever goes wrong, even a bug here, must not take the node down.
trap 'exit 0' EXIT
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# The agent's home (wattwatch-agent.service uses /var/lib/wattwatch).
AGENT_HOME="${WATTWATCH_HOME:-/var/lib/wattwatch}"
# Where the prolog notes the jobs it started, for the epilog (root only; tmpfs is right: a reboot ends them).
STATE_DIR="${WATTWATCH_SLURM_STATE:-/run/wattwatch-slurm}"
# Partition -> kind, for jobs whose comment names none, e.g. "serve:inference debug:other".
PARTITION_KINDS="${WATTWATCH_SLURM_PARTITION_KINDS:-}"

# To syslog, and to stderr (slurmd logs a failing script's output; tests read it).
log() {
    printf 'wattwatch-prolog: %s\n' "$*" >&2
    logger -t wattwatch-prolog -p daemon.warning -- "$*" 2>/dev/null || true
}

# Characters allowed in the JSON strings this script writes: no quoting needed, nothing to inject.
safe() {
    local value=${1//[^A-Za-z0-9_.:@\/+=-]/-}
    printf '%s' "${value:0:200}"
}

job_id="${SLURM_JOB_ID:-}"
if [[ ! "$job_id" =~ ^[0-9]+$ ]]; then
    log "SLURM_JOB_ID is not set or not a number ('$job_id'); nothing to do"
    exit 0
fi

kind=""
name="${SLURM_JOB_NAME:-slurm-$job_id}"
labels="\"slurm.job_id\": \"$job_id\""
[[ -n "${SLURM_JOB_USER:-}" ]] && labels+=", \"slurm.user\": \"$(safe "$SLURM_JOB_USER")\""
[[ -n "${SLURM_JOB_PARTITION:-}" ]] && labels+=", \"slurm.partition\": \"$(safe "$SLURM_JOB_PARTITION")\""
[[ -n "${SLURM_JOB_ACCOUNT:-}" ]] && labels+=", \"slurm.account\": \"$(safe "$SLURM_JOB_ACCOUNT")\""

# The comment: words wattwatch.kind=K, wattwatch.name=N and wattwatch.label.KEY=VALUE; others are ignored.
comment="${SLURM_JOB_COMMENT:-}"
set -f  # split the comment into words; never expand them as file names
for word in ${comment//,/ }; do
    case "$word" in
        wattwatch.kind=*) kind="${word#wattwatch.kind=}" ;;
        wattwatch.name=*) name="${word#wattwatch.name=}" ;;
        wattwatch.label.?*=*)
            pair="${word#wattwatch.label.}"
            labels+=", \"$(safe "${pair%%=*}")\": \"$(safe "${pair#*=}")\""
            ;;
    esac
done
if [[ -z "$kind" && -n "${SLURM_JOB_PARTITION:-}" ]]; then
    for entry in $PARTITION_KINDS; do
        [[ "${entry%%:*}" == "$SLURM_JOB_PARTITION" ]] && kind="${entry#*:}"
    done
fi
if [[ -z "$kind" ]]; then
    exit 0  # discovery names the job and guesses its kind from its processes
fi
case "$kind" in
    training | inference | other) ;;
    *)
        log "job $job_id: kind '$kind' is not training, inference or other; leaving the job to discovery"
        exit 0
        ;;
esac

socket="$AGENT_HOME/agent.sock"
if [[ ! -S "$socket" ]]; then
    log "job $job_id: no wattwatch agent socket at $socket; is wattwatch-agent running?"
    exit 0
fi
if ! command -v socat >/dev/null; then
    log "job $job_id: socat is not installed; install it to send Slurm jobs to the wattwatch agent"
    exit 0
fi

# The note comes first: a record started without one would never be ended by the epilog.
if ! { mkdir -p "$STATE_DIR" && chmod 0700 "$STATE_DIR" && : >"$STATE_DIR/$job_id"; }; then
    log "job $job_id: cannot write $STATE_DIR/$job_id; leaving the job to discovery"
    exit 0
fi
request="{\"op\": \"job_start\", \"id\": \"slurm-$job_id\", \"name\": \"$(safe "$name")\", \"kind\": \"$kind\", \
\"labels\": {$labels}, \"via\": \"slurm-prolog\"}"
reply=$(printf '%s\n' "$request" | timeout 5 socat -t 3 - "UNIX-CONNECT:$socket" 2>&1)
if [[ "$reply" != *'"ok": true'* ]]; then
    rm -f -- "$STATE_DIR/$job_id"
    log "job $job_id: the wattwatch agent did not take the job: ${reply:-no answer}"
fi
exit 0
