#!/usr/bin/env bash
# screen.sh NAME [--set ...]: fastvision's CT Dice at 8 iterations, seeds 0-11 (bf16, NDHWC, instance_cl)
cd /work/main
name=$1; shift
for s in 0 1 2 3 4 5 6 7 8 9 10 11; do
  PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/s53/w --iterations 8 --per-epoch 8 --val-every 8 \
    --datasets spleen --reuse-nnunet --trainers nnunet --tag=-e8-$name-s$s --set train.seed=$s --set train.channels_last=true \
    --set 'model.args.norm="instance_cl"' --set 'train.amp="bf16"' "$@" --json /tmp/s55/scr/$name-s$s.json > /tmp/s55/scr/$name-s$s.log 2>&1 || echo fail $s
  rm -rf /tmp/s53/w/spleen/run-nnunet-e8-$name-s$s
done
python3 - "$name" <<'P'
import json,sys,glob,statistics as st
n=sys.argv[1]; v=[]
for f in sorted(glob.glob(f"/tmp/s55/scr/{n}-s*.json")):
    d=json.load(open(f))["spleen"]; k=[k for k in d if k not in("plan","nnunet")][0]; v.append(d[k]["curve"][0]["dice"])
print(n, "mean %.3f median %.3f min %.3f"%(st.mean(v),st.median(v),min(v)), " ".join("%.2f"%x for x in v))
P
