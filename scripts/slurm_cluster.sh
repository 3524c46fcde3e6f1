#!/usr/bin/env bash
# Bring a real single-node SLURM cluster up or down on this machine (for CI and local tests).
#
#   scripts/slurm_cluster.sh up        install packages if missing, start munge/slurmctld/slurmd,
#                                      return once a real `srun` works (idempotent, ~0.3 s if up)
#   scripts/slurm_cluster.sh down      stop the daemons this script started (state is kept)
#   scripts/slurm_cluster.sh down --purge   also forget all jobs and the generated config
#   scripts/slurm_cluster.sh status    print daemon and node state; exit 0 only if srun works
#
# Needs root and Debian/Ubuntu apt (packages: slurmctld slurmd slurm-client munge). No systemd
# needed: the daemons are started by hand because CI containers rarely run an init system.
# Environment knobs:
#   SLURM_FAKE_GPUS=N   advertise N dummy GPUs (gres/gpu, default 4) so --gpus-per-node/--gpus-per-task
#                       set CUDA_VISIBLE_DEVICES/SLURM_STEP_GPUS exactly as on a GPU cluster; 0 = none
#   SLURM_CPUS=N        CPUs advertised to Slurm (default 8 or nproc if larger): more than the real
#                       cores so that `srun -n4` on a 2-core runner is scheduled instead of queued forever
#   SLURM_CLUSTER_DIR=DIR   a private cluster: its config, state, logs, pid files and its own munged
#                       (socket and key) all under DIR, on the ports SLURM_CLUSTER_PORT and the next
#                       one; nothing of the machine's /etc/slurm or /run/munge is read or touched.
#                       Clients reach it with SLURM_CONF=DIR/etc/slurm.conf. tests/fault/test_slurm.py
#                       starts and stops one per session, so it never uses a cluster it finds.
#   SLURM_CLUSTER_PORT=P    slurmctld's port (slurmd: P+1); default 6817
set -euo pipefail

PRIVATE=${SLURM_CLUSTER_DIR:-}
if [[ -n $PRIVATE ]]; then
  mkdir -p "$PRIVATE"
  PRIVATE=$(cd "$PRIVATE" && pwd)
  chmod 0755 "$PRIVATE"  # munged runs as munge and must reach its socket and key under it
  CONF_DIR=$PRIVATE/etc
  STATE_DIR=$PRIVATE/state
  LOG_DIR=$PRIVATE/log
  RUN_DIR=$PRIVATE/run
  FAKE_GPU_DIR=$PRIVATE/fakegpu
  MUNGE_DIR=$PRIVATE/munge
  MUNGE_SOCKET=$MUNGE_DIR/munge.socket.2
  MUNGE_PID=$MUNGE_DIR/munged.pid
  CLUSTER_NAME=jaxrat$(printf '%s' "$PRIVATE" | cksum | cut -d' ' -f1)
else
  CONF_DIR=/etc/slurm
  STATE_DIR=/var/lib/slurm
  LOG_DIR=/var/log/slurm
  RUN_DIR=/run
  FAKE_GPU_DIR=/run/slurm-fakegpu
  MUNGE_DIR=""
  MUNGE_SOCKET=""
  MUNGE_PID=/run/munge/munged.pid
  CLUSTER_NAME=localcluster
fi
CONF=$CONF_DIR/slurm.conf
GRES_CONF=$CONF_DIR/gres.conf
export SLURM_CONF=$CONF  # the client commands below (srun, squeue, scancel, sinfo) talk to this cluster
CTLD_PID=$RUN_DIR/slurmctld.pid
SLURMD_PID=$RUN_DIR/slurmd.pid
PORT=${SLURM_CLUSTER_PORT:-6817}
NODE=$(hostname -s)
FAKE_GPUS=${SLURM_FAKE_GPUS:-4}
CPUS=${SLURM_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

pid_alive() {  # pid_alive PIDFILE -> true when the pid in it is a live (non-zombie) process
  [[ -s $1 ]] || return 1
  local pid state
  pid=$(cat "$1")
  state=$(ps -o stat= -p "$pid" 2>/dev/null || true)
  [[ -n $state && $state != Z* ]]
}

proc_alive() {  # proc_alive PID -> true for a live (non-zombie) process
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null || true)
  [[ -n $state && $state != Z* ]]
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME: TERM, wait up to 10 s, then KILL
  local pidfile=$1 name=$2 pid
  if pid_alive "$pidfile"; then
    # Follow the pid, not the file: slurmd deletes its pidfile long before it has exited.
    pid=$(cat "$pidfile")
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do proc_alive "$pid" || break; sleep 0.1; done
    if proc_alive "$pid"; then
      log "$name (pid $pid) ignored TERM for 10 s: killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$pidfile"
}

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  [[ $EUID -eq 0 ]] || die "packages ${missing[*]} are missing and installing them needs root; run as root or apt-get install them first."
  command -v apt-get >/dev/null || die "packages ${missing[*]} are missing and apt-get is not available; install them with your package manager."
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Try without refreshing the lists first: a warm CI image saves the ~4 s update.
  if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/slurm_cluster_apt.log 2>&1; then
    apt-get update -qq >>/tmp/slurm_cluster_apt.log 2>&1
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >>/tmp/slurm_cluster_apt.log 2>&1 \
      || die "apt-get install ${missing[*]} failed; see /tmp/slurm_cluster_apt.log."
  fi
}

ensure_hostname() {
  # Slurm puts the node name into SLURM_*NODELIST and jax uses it as the coordinator host.
  if ! getent hosts "$NODE" >/dev/null; then
    log "adding '127.0.0.1 $NODE' to /etc/hosts"
    echo "127.0.0.1 $NODE" >>/etc/hosts
  fi
}

munge_works() {
  if [[ -n $MUNGE_SOCKET ]]; then
    munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1
  else
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
  fi
}

start_private_munge() {  # a munged of this cluster's own: its socket and key under $MUNGE_DIR
  munge_works && return 0
  install -d -o munge -g munge -m 0755 "$MUNGE_DIR"  # clients need to reach the socket in it
  if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=128 count=1 status=none
  fi
  chown munge:munge "$MUNGE_DIR/munge.key"
  chmod 0400 "$MUNGE_DIR/munge.key"
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_PID" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
  for _ in $(seq 50); do
    munge_works && return 0
    sleep 0.1
  done
  die "munged did not start; see $MUNGE_DIR/munged.log."
}

start_munge() {
  [[ -n $MUNGE_DIR ]] && { start_private_munge; return; }
  if munge_works; then return 0; fi
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /etc/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=128 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  # munged refuses to run as root with a key owned by munge, so run it as munge.
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged did not start; see /var/log/munge/munged.log."
}

render_conf() {
  local gres_line="" node_gres=""
  if ((FAKE_GPUS > 0)); then
    gres_line="GresTypes=gpu"
    node_gres=" Gres=gpu:$FAKE_GPUS"
  fi
  cat <<EOF
# Generated by jaxrat scripts/slurm_cluster.sh: a one-node test cluster.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
${MUNGE_SOCKET:+AuthInfo=socket=$MUNGE_SOCKET}
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
InactiveLimit=0
MailProg=/bin/true
SlurmdParameters=config_overrides
$gres_line
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=8000$node_gres State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

write_conf() {  # prints "changed" when the config on disk was replaced
  mkdir -p "$CONF_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$LOG_DIR" "$RUN_DIR"
  local new changed=""
  new=$(render_conf)
  if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$new" ]]; then
    printf '%s\n' "$new" >"$CONF"
    changed=1
  fi
  if ((FAKE_GPUS > 0)); then
    # Slurm drops a gpu GRES without File=, and rejects regular files: character devices
    # with /dev/null's numbers are accepted and harmless.
    mkdir -p "$FAKE_GPU_DIR"
    for ((i = 0; i < FAKE_GPUS; i++)); do
      [[ -c $FAKE_GPU_DIR/gpu$i ]] || mknod "$FAKE_GPU_DIR/gpu$i" c 1 3
    done
    local gres="Name=gpu File=$FAKE_GPU_DIR/gpu[0-$((FAKE_GPUS - 1))]"
    if [[ ! -f $GRES_CONF ]] || [[ "$(cat "$GRES_CONF")" != "$gres" ]]; then
      echo "$gres" >"$GRES_CONF"
      changed=1
    fi
  elif [[ -f $GRES_CONF ]]; then
    rm -f "$GRES_CONF"
    changed=1
  fi
  [[ -n $changed ]] && echo changed || true
}

srun_works() { timeout "${1:-10}" srun -N1 -n1 --quit-on-interrupt true >/dev/null 2>&1; }

cmd_up() {
  [[ $EUID -eq 0 ]] || die "bringing the cluster up needs root (it writes /etc/slurm and starts daemons); run it with sudo or as root."
  install_packages
  ensure_hostname
  start_munge
  local changed
  changed=$(write_conf)
  if [[ -n $changed ]] && { pid_alive "$CTLD_PID" || pid_alive "$SLURMD_PID"; }; then
    log "config changed: restarting the daemons"
    stop_pidfile "$SLURMD_PID" slurmd
    stop_pidfile "$CTLD_PID" slurmctld
  fi
  if [[ -z $changed ]] && pid_alive "$CTLD_PID" && pid_alive "$SLURMD_PID" && srun_works 10; then
    log "already up (node $NODE)"
    return 0
  fi
  pid_alive "$CTLD_PID" || /usr/sbin/slurmctld -f "$CONF"
  pid_alive "$SLURMD_PID" || /usr/sbin/slurmd -f "$CONF" -N "$NODE"
  # `sinfo` can report idle from saved state before slurmd registers, so only a real srun proves it.
  local deadline=$((SECONDS + 60))
  while ((SECONDS < deadline)); do
    if srun_works 5; then
      log "up: node $NODE, $CPUS CPUs, $FAKE_GPUS fake GPUs, port $PORT, config $CONF"
      return 0
    fi
    # A node left DOWN/DRAIN by an earlier run must be resumed by hand.
    scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
    sleep 0.5
  done
  die "srun still fails after 60 s; see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log."
}

cmd_down() {
  if command -v squeue >/dev/null && pid_alive "$CTLD_PID" && pid_alive "$MUNGE_PID"; then
    # Cancel every job first so that no slurmstepd outlives slurmd (it would hang without munge).
    local jobs
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      log "cancelling jobs: $(echo $jobs)"
      timeout 10 scancel --full $jobs 2>/dev/null || true
      for _ in $(seq 30); do [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
    fi
  fi
  stop_pidfile "$SLURMD_PID" slurmd
  stop_pidfile "$CTLD_PID" slurmctld
  stop_pidfile "$MUNGE_PID" munged
  if [[ ${1:-} == --purge ]]; then
    log "purging job state, logs and generated config"
    rm -rf "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$FAKE_GPU_DIR" "$CONF" "$GRES_CONF"
    rm -f "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd.log
    [[ -n $PRIVATE ]] && rm -rf "$PRIVATE"
  fi
  log "down"
}

cmd_status() {
  local ok=0
  for d in "munged:$MUNGE_PID" "slurmctld:$CTLD_PID" "slurmd:$SLURMD_PID"; do
    if pid_alive "${d#*:}"; then echo "${d%%:*}: running (pid $(cat "${d#*:}"))"; else echo "${d%%:*}: stopped"; ok=1; fi
  done
  if ((ok == 0)); then
    timeout 10 sinfo -N -o '%N %T %c %G' || true
    srun_works 10 && echo "srun: works" || { echo "srun: fails"; ok=1; }
  fi
  return $ok
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down "${2:-}" ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|down [--purge]|status" >&2; exit 2 ;;
esac
