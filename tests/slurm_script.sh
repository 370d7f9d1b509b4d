#!/usr/bin/env bash
# launch/slurm/moeut.sbatch run as SLURM runs it, with stand-ins for mpirun, srun and scontrol:
# - the launch line: every rank, ranks per node, no core binding, OMP_NUM_THREADS from
#   --cpus-per-task, the NCCL variables passed on, --resume auto before the user's options;
# - SLURM's warning signal to the batch shell reaches the run as SIGUSR1; a run that then exits
#   75 (stopped with a checkpoint) has the job requeued, and the script exits 75;
# - a run that ends normally is not requeued; srun as the launcher.
# Usage: slurm_script.sh WORK_DIR
set -euo pipefail
work=$1
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work" && mkdir -p "$work/path" "$work/bin"
fail() { echo "FAIL: $*"; exit 1; }
printf '#!/bin/sh\nexit 0\n' > "$work/bin/moeut-train"
# The launcher stand-in records its arguments and environment, then runs until SIGUSR1 (exit
# 75, as moeut-train does after saving) or, with STAND_IN_DONE set, ends at once.
for launcher in mpirun srun; do
  cat > "$work/path/$launcher" <<SH
#!/usr/bin/env bash
echo "$launcher \$* | OMP_NUM_THREADS=\$OMP_NUM_THREADS NCCL_SOCKET_IFNAME=\${NCCL_SOCKET_IFNAME:-}" > "$work/launched.txt"
[ -n "\${STAND_IN_DONE:-}" ] && exit 0
trap 'exit 75' USR1
while :; do sleep 0.05; done
SH
done
printf '#!/bin/sh\necho "scontrol $*" >> "%s/scontrol.txt"\n' "$work" > "$work/path/scontrol"
chmod +x "$work/path/"* "$work/bin/moeut-train"
export PATH="$work/path:$PATH" MOEUT_BIN="$work/bin" SLURM_NTASKS=4 SLURM_NTASKS_PER_NODE="2(x2)" SLURM_CPUS_PER_TASK=3 \
  SLURM_JOB_ID=42 SLURM_JOB_NUM_NODES=2 NCCL_SOCKET_IFNAME=ib0
unset OMP_NUM_THREADS

"$root/launch/slurm/moeut.sbatch" --config c.cfg --checkpoint_dir /shared/ckpt > "$work/job.txt" 2>&1 &
job=$!
for _ in $(seq 1 100); do [ -s "$work/launched.txt" ] && break; sleep 0.05; done
kill -USR1 "$job"  # SLURM's --signal=B:USR1@300
status=0
wait "$job" || status=$?
[ "$status" = 75 ] || fail "the stopped job exited $status, not 75 ($(cat "$work/job.txt"))"
grep -qx "scontrol requeue 42" "$work/scontrol.txt" || fail "the stopped job was not requeued"
launched=$(cat "$work/launched.txt")
[[ "$launched" == "mpirun -np 4 --map-by ppr:2:node --bind-to none -x OMP_NUM_THREADS "* ]] || fail "mpirun line: $launched"
[[ "$launched" == *"-x NCCL_SOCKET_IFNAME "* ]] || fail "NCCL variables not passed on: $launched"
[[ "$launched" == *"$work/bin/moeut-train --resume auto --config c.cfg --checkpoint_dir /shared/ckpt |"* ]] ||
  fail "moeut-train's options: $launched"
[[ "$launched" == *"OMP_NUM_THREADS=3 NCCL_SOCKET_IFNAME=ib0" ]] || fail "environment: $launched"

rm -f "$work/scontrol.txt"
STAND_IN_DONE=1 MOEUT_LAUNCHER=srun "$root/launch/slurm/moeut.sbatch" --config c.cfg > "$work/job2.txt" 2>&1 ||
  fail "a job that ended normally failed ($(cat "$work/job2.txt"))"
[ ! -e "$work/scontrol.txt" ] || fail "a job that ended normally was requeued"
[[ "$(cat "$work/launched.txt")" == "srun --kill-on-bad-exit=1 --cpu-bind=none --cpus-per-task=3 $work/bin/moeut-train --resume auto --config c.cfg |"* ]] ||
  fail "srun line: $(cat "$work/launched.txt")"
echo "slurm script: ok"
