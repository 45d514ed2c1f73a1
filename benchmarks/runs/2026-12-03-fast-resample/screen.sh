#!/usr/bin/env bash
# configure --trainer fast on the generated CT set: MONAI's preprocessing order (as configured) against
# data.args.resample=nnunet, seeds interleaved, bf16, NDHWC + instance_cl, 64 iterations, scored as nnU-Net scores.
cd /work/main
O=${O:-/tmp/s59/fast}  # 2026-12-03: screen.sh 0 ... 11 (05:54-06:07 UTC; seeds 9-11 rerun after /tmp filled up)
for r in "$@"; do
  for v in monai nnunet; do
    env PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/s53/w --iterations 64 --per-epoch 8 \
      --val-every 8 --datasets spleen --reuse-nnunet --trainers fast --tag=-f$v-r$r --set train.seed=$r \
      --set train.channels_last=true --set 'model.args.norm="instance_cl"' --set 'train.amp="bf16"' \
      --set "data.args.resample=\"$v\"" --json $O/$v-r$r.json > $O/$v-r$r.log 2>&1
    echo "r$r $v $(date +%T) $(tail -1 $O/$v-r$r.log)"
  done
done
echo done
