#!/usr/bin/env bash
# The precision study (experiments/precision/PLAN.md, pre-registered): the paper's perplexity claims
# in pure bf16 with every reduction rounded at each hop of its ring, and with the reductions in fp32,
# simulated in one process (+experiment=precision: cluster=simulate, cluster.reductions=ring).
#   bash experiments/precision.sh [OUT] [--reduced] [--until pilot] [--allow-mixed] [KEY=VALUE...]   default OUT: outputs/precision/DATE_TIME
# Phases (Hydra multiruns, records in OUT/runs/PHASE/<the swept values>/), as the plan orders:
#   pilot   the 8 arms (FSDP, HSDP, FL+FSDP, FL+HSDP x bf16 / fp32 reductions) on seeds 200-202: the
#           paired SDs and the times per run that set the judging seeds
#   judge   the bf16 arms on seeds 0..N-1, the fp32r arms on 0..N_fp32r-1 (the plan's rule)
# then OUT/report/ (python -m analysis.precision). Run again with the same OUT: finished points are
# skipped (trainer.skip_finished). --until pilot stops after the pilot. --allow-mixed lets the
# analysis take runs made at several commits. --reduced (CI, ~2 min idle): the paper's mesh relations
# at 8 ranks (topology=local_4x2), 4 steps, pilot on 2 seeds, N = 2; it checks the pipeline, its
# numbers judge nothing.
set -uo pipefail
. "$(dirname "$0")/study_args.sh"
study_args precision "pilot|judge" "$@"
if [ "$REDUCED" = 1 ]; then
    PILOT_SEEDS=200,201; FIXED_N=2; OVERRIDES=(topology=local_4x2 trainer.steps=4 "${OVERRIDES[@]}")
else
    PILOT_SEEDS=200,201,202; FIXED_N=
fi
start=$SECONDS
status=0
multirun() {  # PHASE SEEDS OVERRIDES...: one Hydra multirun into OUT/runs/PHASE
    local phase=$1 seeds=$2
    shift 2
    echo "precision: $phase $* seed=$seeds ($((SECONDS - start)) s so far)"
    python -m fldp.train -m +experiment=precision "hydra.sweep.dir=$OUT/runs/$phase" "$@" "seed=$seeds" \
        "${OVERRIDES[@]}" || status=1
}
run() {  # PHASE SEEDS REDUCTIONS: the four algorithms in one reductions arm (FedAvg's dtype: FL only)
    local phase=$1 seeds=$2 reductions=$3
    if [ "$reductions" = bf16 ]; then
        multirun "$phase" "$seeds" algorithm=fsdp,hsdp,fl_fsdp,fl_hsdp
    else
        multirun "$phase" "$seeds" algorithm=fsdp,hsdp fsdp.reduce_dtype=fp32
        multirun "$phase" "$seeds" algorithm=fl_fsdp,fl_hsdp fsdp.reduce_dtype=fp32 algorithm.outer.reduce_dtype=fp32
    fi
}
finish() { study_finish precision; }

for reductions in bf16 fp32r; do run pilot "$PILOT_SEEDS" "$reductions"; done
[ "$UNTIL" = pilot ] && finish
eval "$(python -m analysis.precision "$OUT/runs" --decide $MIXED ${FIXED_N:+--seeds $FIXED_N})" || exit 1
if [ -z "${seeds:-}" ]; then echo "precision: the pilot is incomplete: no judging seeds" >&2; status=1; finish; fi
run judge "$(seq -s, 0 $((seeds - 1)))" bf16
run judge "$(seq -s, 0 $((seeds_fp32r - 1)))" fp32r
finish
