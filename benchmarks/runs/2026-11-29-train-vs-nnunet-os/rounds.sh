#!/usr/bin/env bash
# CT (spleen) paired rounds at 64 iterations: nnU-Net once, then fastvision's configured recipe in NDHWC + instance_cl
# (train.seed=r), its validations scored as nnU-Net scores its own (original grid, score_as_nnunet)
cd /work/main
B="env PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/s52/w --iterations 64 --per-epoch 8 --val-every 8"
for r in "$@"; do
  echo "round $r nnunet $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  $B --datasets spleen --trainers --nnunet-runs 1 > /tmp/s52/r64/nn-r$r.log 2>&1
  cp /tmp/s52/w/spleen/nnunet_side.json /tmp/s52/r64/nnunet-spleen-r$r.json
  echo "round $r fv $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  $B --datasets spleen --reuse-nnunet --trainers nnunet --tag=-os-r$r --set train.seed=$r \
     --set train.channels_last=true --set 'model.args.norm="instance_cl"' --json /tmp/s52/r64/fv-spleen-r$r.json > /tmp/s52/r64/fv-r$r.log 2>&1
  tail -2 /tmp/s52/r64/fv-r$r.log
done
echo "done $(date +%T)"
