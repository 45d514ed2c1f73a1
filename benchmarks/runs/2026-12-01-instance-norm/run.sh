#!/usr/bin/env bash
# side by side: the new instance_cl (work tree) and the old one (HEAD worktree at /tmp/oldfv), alternating
R=/work/main/benchmarks/runs/2026-11-29-layout-cpu
for i in 1 2; do
  for t in new old; do
    d=/work/main; [ $t = old ] && d=/tmp/oldfv
    (cd $d && OMP_NUM_THREADS=2 PYTHONPATH=$d /work/main/.venv/bin/python benchmarks/layout_copies.py --recipe $R/ct-nnunet.yaml --rounds 7 --steps 3 2>&1 | grep -v USDT > /tmp/s53/norm/lc-$t-$i.md)
    (cd $d && OMP_NUM_THREADS=2 PYTHONPATH=$d /work/main/.venv/bin/python -m fastvision benchmark $R/ct-nnunet.yaml --device cpu --precision fp32,bf16 --steps 20 --warmup 5 --channels-last --set 'model.args.norm="instance_cl"' --out /tmp/s53/norm/b-$t-$i --force 2>&1 | grep "│" > /tmp/s53/norm/b-$t-$i.txt)
    echo "$t $i done $(date +%T)"
  done
done
