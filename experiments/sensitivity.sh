#!/usr/bin/env bash
# The sensitivity study (experiments/sensitivity/PLAN.md, pre-registered): the paper-shape verdicts
# at the paper's own lr (3e-4 for every arm) and with gradient clipping at 1.0, beside the paper-shape
# judging runs run again for their per-step losses (+experiment=paper_shape, fp32, cluster=simulate).
#   bash experiments/sensitivity.sh [OUT] [--reduced] [--until PHASE] [--allow-mixed] [KEY=VALUE...]   default OUT: outputs/sensitivity/DATE_TIME
# Phases (Hydra multiruns, records in OUT/runs/PHASE/<the swept values>/), as the plan orders:
#   base      FSDP, FL+FSDP, FL+HSDP at lr 1e-2, no clipping, seeds 0-19 (the paper-shape judging runs)
#   paper_lr  the three at lr 3e-4, seeds 0-9
#   clip      the three at lr 1e-2 with optimizer.clip_norm=1.0, seeds 0-9
# then OUT/report/ (python -m analysis.sensitivity). Run again with the same OUT: finished points
# are skipped (trainer.skip_finished), so the phases may run in several sessions (--allow-mixed
# then lets the analysis take runs made at several commits). --reduced (CI, ~1 min idle): the paper's
# mesh relations at 8 ranks (topology=local_4x2), 4 steps, seeds 0-1 everywhere; it checks the
# pipeline, its numbers judge nothing.
set -uo pipefail
. "$(dirname "$0")/study_args.sh"
study_args sensitivity "base|paper_lr|clip" "$@"
LR=1e-2 PAPER_LR=3e-4  # the paper-shape study's choice for every arm; the paper's (the plan's Setting)
if [ "$REDUCED" = 1 ]; then
    BASE_SEEDS=0,1 SEEDS=0,1; OVERRIDES=(topology=local_4x2 trainer.steps=4 dataset.eval_blocks=64 "${OVERRIDES[@]}")
else
    BASE_SEEDS=$(seq -s, 0 19) SEEDS=$(seq -s, 0 9)
fi
start=$SECONDS
status=0
run() {  # PHASE SEEDS OVERRIDES...: the three arms in one Hydra multirun into OUT/runs/PHASE
    local phase=$1 seeds=$2
    shift 2
    echo "sensitivity: $phase $* seed=$seeds ($((SECONDS - start)) s so far)"
    # seed before algorithm: Hydra varies the last override fastest, so a phase cut short has whole seeds
    python -m fldp.train -m +experiment=paper_shape trainer.precision=fp32 "hydra.sweep.dir=$OUT/runs/$phase" \
        "seed=$seeds" algorithm=fsdp,fl_fsdp,fl_hsdp "$@" "${OVERRIDES[@]}" || status=1
}
finish() { study_finish sensitivity; }

run base "$BASE_SEEDS" "optimizer.lr=$LR"
[ "$UNTIL" = base ] && finish
run paper_lr "$SEEDS" "optimizer.lr=$PAPER_LR"
[ "$UNTIL" = paper_lr ] && finish
run clip "$SEEDS" "optimizer.lr=$LR" optimizer.clip_norm=1.0
finish
