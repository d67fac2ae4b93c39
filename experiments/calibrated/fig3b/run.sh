#!/bin/bash
# Fig. 3b (PLAN.md): the batch gradient's covariance trace, K=16 batches of B=128, at the base model and at seed 0's
# last checkpoints of the sweep, measurement seeds 0-4. Run from the worktree pinned at the plan's commit, once
# spo-s0 and grpo-s0 have finished there (their run directories hold the checkpoints); v0_base.json came from:
#   python offline_values.py --toy_dir tasks/built/toy_sharp --max_prompts 1024 --temperature 0.5 --n0 8 --seed 0 \
#       --out experiments/calibrated/fig3b/v0_base.json
set -e
cd "$(dirname "$0")/../../.."
T=tasks/built/toy_sharp
RUNS=experiments/calibrated/runs
OUT=experiments/calibrated/fig3b
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
for seed in 0 1 2 3 4; do
  $PY -m experiments.gradient_variance --model $T/model --algo grpo --train $T/train.parquet --train_prompts 1024 \
      --seed $seed --json $OUT/grpo_base_m$seed.json | tail -1
  $PY -m experiments.gradient_variance --model $T/model --algo spo --offline_values $OUT/v0_base.json \
      --train $T/train.parquet --train_prompts 1024 --seed $seed --json $OUT/spo_base_m$seed.json | tail -1
  $PY -m experiments.gradient_variance --model $RUNS/grpo-s0/checkpoints/step_000364/model --algo grpo \
      --train $T/train.parquet --train_prompts 1024 --seed $seed --json $OUT/grpo_final_m$seed.json | tail -1
  $PY -m experiments.gradient_variance --model $RUNS/spo-s0/checkpoints/step_000300/model --algo spo \
      --train $T/train.parquet --seed $seed --json $OUT/spo_final_m$seed.json | tail -1
done
$PY -m experiments.gradient_variance summary $OUT/*_m?.json > $OUT/summary.md
