#!/usr/bin/env bash
# How tests/data/previous-release-events.jsonl was made: three `ftkit demo` runs of the main
# checkout at 122984e (the release before the goodput report, so no timing facts), with
# SLURM_JOB_ID / SLURM_RESTART_COUNT set by hand to look like one requeued SLURM job:
#   run 1 killed with kill -9 after its checkpoint at step 200,
#   run 2 resumed from 200 and stopped by SIGUSR1 (save at 402, exit, requeue wish),
#   run 3 resumed from 402 and completed 600 steps.
# (With SLURM_JOB_ID set, the time budget asked `scontrol show job 1001`, which found no such
# job; set FTKIT_DEADLINE to avoid that lookup when re-making it.)
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
