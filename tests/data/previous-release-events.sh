set -x
export PYTHONPATH=/work/main
J=/tmp/fx18/job
# run 1: SLURM-like job 1001, restart 0, killed with -9 mid-run
SLURM_JOB_ID=1001 SLURM_RESTART_COUNT=0 python3 -m ftkit demo --no-live --jobdir $J --steps 600 --step-time 0.01 --save-every 100 > r1.log 2>&1 &
P=$!
for i in $(seq 200); do grep -q "\"step\": 200" $J/events.jsonl 2>/dev/null && break; sleep 0.1; done
sleep 0.3; kill -9 $P; wait $P
# run 2: restart 1, stopped by USR1 (requeue)
SLURM_JOB_ID=1001 SLURM_RESTART_COUNT=1 python3 -m ftkit demo --no-live --jobdir $J --steps 600 --step-time 0.01 --save-every 100 > r2.log 2>&1 &
P=$!
for i in $(seq 200); do grep -q '"step": 400' $J/events.jsonl && break; sleep 0.1; done
kill -USR1 $P; wait $P; echo rc=$?
# run 3: restart 2, completes
SLURM_JOB_ID=1001 SLURM_RESTART_COUNT=2 python3 -m ftkit demo --no-live --jobdir $J --steps 600 --step-time 0.01 --save-every 100 > r3.log 2>&1
