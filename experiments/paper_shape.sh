#!/usr/bin/env bash
# The paper-shape study (experiments/paper_shape/PLAN.md, pre-registered): the paper's perplexity
# claims at its own shape, simulated in one process (+experiment=paper_shape, cluster=simulate).
#   bash experiments/paper_shape.sh [OUT] [--reduced] [--until PHASE] [--allow-mixed] [KEY=VALUE...]   default OUT: outputs/paper_shape/DATE_TIME
# Phases (a Hydra multirun each, records in OUT/runs/PHASE/<the swept values>/), as the plan orders:
#   tune    the lr grid for FSDP, FL+FSDP and FL+HSDP on tuning seeds 100, 101 (extended once past an edge)
#   hsdp    HSDP on one seed at FSDP's lr: the same computation as FSDP (bit-identical records)
#   pilot   each arm at its chosen lr on seeds 200-204: the paired SDs that set the judging seeds N
#   judge   each arm at its chosen lr, and at the shared lr (FSDP's) where that differs, seeds 0..N-1
# then OUT/report/ (python -m analysis.paper_shape; losses.csv.gz: every run's loss at every step).
# Run again with the same OUT: finished points are skipped (trainer.skip_finished). --until PHASE
# stops after that phase (say, tune and pilot today, judge another day). --allow-mixed lets the
# analysis take runs made at several commits (a study run over days; it names them). --reduced
# (CI, ~1 min idle): the paper's mesh relations at 8 ranks (topology=local_4x2), 4 steps, 64 held-out
# blocks, lr 1e-2 and 3e-2, one tuning seed, pilot on 2 seeds, N = 2; it checks the pipeline, its
# numbers judge nothing (tests/test_simulate.py runs a 512-rank layout, FL+FSDP 128x1x4).
set -uo pipefail
. "$(dirname "$0")/study_args.sh"
study_args paper_shape "tune|hsdp|pilot|judge" "$@"
ARMS=(fsdp fl_fsdp fl_hsdp)
if [ "$REDUCED" = 1 ]; then
    GRID=1e-2,3e-2; TUNE_SEEDS=100; PILOT_SEEDS=200,201; FIXED_N=2
    OVERRIDES=(topology=local_4x2 trainer.steps=4 dataset.eval_blocks=64 "${OVERRIDES[@]}")
else
    GRID=1e-3,3e-3,1e-2,3e-2,1e-1; TUNE_SEEDS=100,101; PILOT_SEEDS=200,201,202,203,204; FIXED_N=
fi
start=$SECONDS
status=0
run() {  # PHASE OVERRIDES...: one multirun into OUT/runs/PHASE
    local phase=$1
    shift
    echo "paper_shape: $phase $* ($((SECONDS - start)) s so far)"
    python -m fldp.train -m +experiment=paper_shape trainer.precision=fp32 "hydra.sweep.dir=$OUT/runs/$phase" \
        "$@" "${OVERRIDES[@]}" || status=1
}
decide() {  # what the plan's rules make of the runs so far: lr_<arm>=..., extend_<arm>=..., seeds=...
    python -m analysis.paper_shape "$OUT/runs" --decide $MIXED ${FIXED_N:+--seeds $FIXED_N} || exit 1
}
finish() { study_finish paper_shape; }

run tune "algorithm=$(IFS=,; echo "${ARMS[*]}")" "optimizer.lr=$GRID" "seed=$TUNE_SEEDS"
eval "$(decide)"
for arm in "${ARMS[@]}"; do  # the plan: a best lr at the grid's edge gets one more value past it
    extra=extend_$arm
    if [ -n "${!extra:-}" ]; then run tune "algorithm=$arm" "optimizer.lr=${!extra}" "seed=$TUNE_SEEDS"; fi
done
eval "$(decide)"
[ "$UNTIL" = tune ] && finish
run hsdp algorithm=hsdp "optimizer.lr=$lr_fsdp" seed=0
[ "$UNTIL" = hsdp ] && finish
for arm in "${ARMS[@]}"; do
    lr=lr_$arm
    run pilot "algorithm=$arm" "optimizer.lr=${!lr}" "seed=$PILOT_SEEDS"
done
eval "$(decide)"
[ "$UNTIL" = pilot ] && finish
SEEDS=$(seq -s, 0 $((seeds - 1)))
for arm in "${ARMS[@]}"; do
    lr=lr_$arm
    run judge "algorithm=$arm" "optimizer.lr=${!lr}" "seed=$SEEDS"
    if [ "${!lr}" != "$lr_fsdp" ]; then run judge "algorithm=$arm" "optimizer.lr=$lr_fsdp" "seed=$SEEDS"; fi
done
finish
