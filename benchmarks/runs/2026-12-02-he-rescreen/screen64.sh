#!/usr/bin/env bash
# screen64.sh NAME SEEDS... -- [--set ...]: fastvision's CT curve over 64 iterations (fp32, NDHWC, instance_cl)
cd /work/main
name=$1; shift; seeds=(); while [[ $# -gt 0 && $1 != -- ]]; do seeds+=($1); shift; done; shift
for s in "${seeds[@]}"; do
  PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/s53/w --iterations 64 --per-epoch 8 --val-every 8 \
    --datasets spleen --reuse-nnunet --trainers nnunet --tag=-s64-$name-s$s --set train.seed=$s --set train.channels_last=true \
    --set 'model.args.norm="instance_cl"' --set 'train.amp="off"' "$@" --json /tmp/s57/scr/$name-s$s.json > /tmp/s57/scr/$name-s$s.log 2>&1 || echo fail $s
  rm -rf /tmp/s53/w/spleen/run-nnunet-s64-$name-s$s
done
