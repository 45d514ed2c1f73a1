#!/usr/bin/env bash
# CT (spleen) paired rounds: nnU-Net once, then fastvision's configured recipe in NDHWC + instance_cl, train.seed=r
cd /work/main
B="env PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/r5/w --iterations 64 --per-epoch 8 --val-every 8"
for r in 0 1 2 3 4 5 6 7; do  # run as 0-3, then 4-7
  echo "round $r nnunet $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  $B --datasets spleen --trainers --nnunet-runs 1 > /tmp/s49/cl/nn-r$r.log 2>&1
  cp /tmp/r5/w/spleen/nnunet_side.json /tmp/s49/cl/nnunet-spleen-r$r.json
  echo "round $r fv $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  $B --datasets spleen --reuse-nnunet --trainers nnunet --tag=-cl-r$r --set train.seed=$r \
     --set train.channels_last=true --set 'model.args.norm="instance_cl"' --json /tmp/s49/cl/fv-spleen-r$r.json > /tmp/s49/cl/fv-r$r.log 2>&1
done
echo "done $(date +%T)"
