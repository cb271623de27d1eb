#!/usr/bin/env bash
# The tiny study of the paper's claims with the controls the paper lacks (conf/experiment/science.yaml,
# analysis/science.py). Every run: tiny_llama, 8 ranks in the paper's mesh relations, 32 steps.
#   bash experiments/science.sh [OUT] [--reduced] [KEY=VALUE...]   any order; default OUT: outputs/science/DATE_TIME
# Parts (one Hydra multirun each, records in OUT/runs/PART/<the swept values>/):
#   tiny_repro  the four algorithms on netns_4x2 (capped links: the times), fp32, shared lr, A = 8
#   frontier    FL+FSDP (F = 4) and FL+HSDP (F = 2) at the other A on netns_4x2
#   bf16        the four algorithms in pure bf16 (loopback), and FL with FedAvg summed in fp32
#   lr          the other two learning rates of the grid (3e-3, 1e-2, 3e-2), fp32, loopback
#   batch       FSDP / HSDP on one FL group's per-update batch: as many steps, and F times as many
# then OUT/tiny_repro/ (Tables 3-4: analysis.report) and OUT/report/ (analysis.science).
# Run again with the same OUT, it skips the points that finished (trainer.skip_finished) and runs the
# rest (the report's time is the sum over the invocations, kept in OUT/elapsed_s); add
# trainer.resume=auto to continue a point that was killed midway.
# Full: 5 seeds (frontier 2), 126 runs of 32 steps. --reduced (CI, 20 runs): 8 steps (1 aggregation
# at A = 8; the controls scaled alike), seed 0 only, A = 4 only in the frontier, lr 3e-2 only beside
# the shared 1e-2: it checks the pipeline, its numbers judge nothing. Needs root and iproute2 for netns_4x2 (as tiny_repro.sh).
set -uo pipefail
OUT=
REDUCED=0
OVERRIDES=()
for arg in "$@"; do
    case "$arg" in
        --reduced) REDUCED=1 ;;
        -*) echo "science.sh: unknown option $arg (usage: [OUT] [--reduced] [KEY=VALUE...])" >&2; exit 2 ;;
        *=*) OVERRIDES+=("$arg") ;;
        *) if [ -n "$OUT" ]; then echo "science.sh: two output directories, $OUT and $arg" >&2; exit 2; fi
           OUT=$arg ;;
    esac
done
case "$OUT" in
    "") ;;
    /*) ;;
    *) OUT="$PWD/$OUT" ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/science/$(date +%Y-%m-%d_%H-%M-%S)}
if [ "$REDUCED" = 1 ]; then
    SEEDS=0; FEW=0; FRONTIER_SEEDS=0; EVERY=4; LRS=3e-2; STEPS=8; STEPS_ARG=(trainer.steps=$STEPS)
else
    SEEDS=0,1,2,3,4; FEW=$SEEDS; FRONTIER_SEEDS=0,1; EVERY=1,2,4,16; LRS=3e-3,3e-2; STEPS=32; STEPS_ARG=()
fi
ALL=fsdp,hsdp,fl_fsdp,fl_hsdp
start=$SECONDS
status=0
part() {
    local name=$1
    shift
    echo "science: part $name ($((SECONDS - start)) s so far)"
    python -m fldp.train -m +experiment=science "hydra.sweep.dir=$OUT/runs/$name" "$@" || status=1
}
part tiny_repro topology=netns_4x2 algorithm=$ALL seed=$SEEDS "${STEPS_ARG[@]}" "${OVERRIDES[@]}"
part frontier topology=netns_4x2 algorithm=fl_fsdp,fl_hsdp algorithm.every=$EVERY seed=$FRONTIER_SEEDS "${STEPS_ARG[@]}" "${OVERRIDES[@]}"
part bf16 trainer.precision=bf16 algorithm=$ALL seed=$SEEDS "${STEPS_ARG[@]}" "${OVERRIDES[@]}"
part bf16_reduce_fp32 trainer.precision=bf16 algorithm=fl_fsdp,fl_hsdp algorithm.outer.reduce_dtype=fp32 seed=$FEW "${STEPS_ARG[@]}" "${OVERRIDES[@]}"
part lr optimizer.lr=$LRS algorithm=$ALL seed=$FEW "${STEPS_ARG[@]}" "${OVERRIDES[@]}"
# one FL+FSDP group: 2 ranks x 2 sequences; token-matched: x F = 4 steps. One FL+HSDP group: R = 2,
# S = 2, 8 sequences; x F = 2 steps. (local_2's FSDP and local_4's HSDP layouts are exactly these.)
part batch_fl_fsdp topology=local_2 algorithm=fsdp trainer.steps=$STEPS,$((STEPS * 4)) seed=$FEW "${OVERRIDES[@]}"
part batch_fl_hsdp topology=local_4 algorithm=hsdp trainer.steps=$STEPS,$((STEPS * 2)) seed=$FEW "${OVERRIDES[@]}"
# run time over every invocation into this OUT (a re-run adds the points it ran to the earlier ones)
elapsed=$(( $(cat "$OUT/elapsed_s" 2>/dev/null || echo 0) + SECONDS - start ))
mkdir -p "$OUT" && echo "$elapsed" > "$OUT/elapsed_s"
# Tables 3-4 on the netns runs; then the study, every run
python -m analysis.report "$OUT/runs/tiny_repro" --out "$OUT/tiny_repro" --strict || status=1
python -m analysis.science "$OUT/runs" --out "$OUT/report" --elapsed "$elapsed" --strict || status=1
echo "science: $elapsed s of runs; report in $OUT/report/report.md, Tables 3-4 in $OUT/tiny_repro/report.md"
exit $status
