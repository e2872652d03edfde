#!/bin/bash
# A SLURM job that saves on preemption and requeues itself: docs/preemption.md, "Schedulers".
#
#   sbatch examples/preemption/sbatch.sh        (from the directory that holds train.py)
#
# 120 s before the time limit SLURM sends SIGUSR1 to this batch shell only (B:); the trap below
# forwards it to the training as SIGTERM, once. scancel, and SLURM's own preemption, send SIGTERM
# to every process of the job: the training gets it directly, and the trap only notes it (a
# forwarded copy would be the second signal, which exits at once). Either way the training saves
# the step it is at and exits 143; this script then requeues the job, which starts this script
# again: train.py resumes from that checkpoint. The decision does not read the exit status:
# under torchrun the ranks exit 143 but torchrun exits 1, with a traceback.
#SBATCH --job-name=txckpt-train
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=4
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=train-%j.log

# The training command; pod.yaml runs the same one (tests/test_preemption_examples.py checks).
# Under torchrun: TRAIN=(torchrun --nproc-per-node=4 train.py ...): each rank saves its part.
TRAIN=(python train.py --root checkpoints/run --steps 200 --save-every 50 --grace 100)

preempted=0
child=
trap 'preempted=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' USR1
trap 'preempted=1' TERM

"${TRAIN[@]}" &
child=$!
status=0
wait "$child" || status=$?
while [ "$preempted" = 1 ] && kill -0 "$child" 2>/dev/null; do
    # The trap ended the first wait early: wait for the training to finish its save and exit.
    status=0
    wait "$child" || status=$?
done
echo "training exited with status $status (preempted: $preempted)"

if [ "$preempted" = 1 ]; then
    scontrol requeue "$SLURM_JOB_ID"  # the job starts again; train.py resumes where it stopped
    exit 0
fi
exit "$status"
