#!/usr/bin/env bash
# fastvision bf16 with nnU-Net's He initialisation everywhere (model.args.init=he), seeds as the rounds'; 2026-12-03: he_screen.sh 0 ... 11 (05:34-05:40 UTC, alone)
cd /work/main
for r in "$@"; do
  env PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/s58/w --iterations 64 --per-epoch 8 --val-every 8 \
    --datasets prostate --reuse-nnunet --trainers nnunet --tag=-he-r$r --set train.seed=$r \
    --set train.channels_last=true --set 'model.args.norm="instance_cl"' --set 'train.amp="bf16"' --set 'model.args.init="he"' \
    --json ${O:-/tmp/s59/he}/fvhe-prostate-r$r.json > ${O:-/tmp/s59/he}/fvhe-r$r.log 2>&1
  echo "r$r $(date +%T) $(tail -1 ${O:-/tmp/s59/he}/fvhe-r$r.log)"
done
echo done
