#!/usr/bin/env bash
# session 6 run 7 (nvidia-h200): the ablation tool with session 3's adjacent-pair tree imported from
# the row-sum test probe instead of its own copy (the adjacent-tree variants and the all-features probe)
OUT=$OUT/a WORK=/tmp/wa STEPS="ablation" ABLATION_TIMEOUT=120 ABLATION_ARGS="--shapes 32x512 --only adjacent|ind" \
  bash tools/benchmarking/gpu_all_run.sh 2>&1 | cut -c1-200 | grep -E "step|Error|error|probe|sdpa" | tail -20
