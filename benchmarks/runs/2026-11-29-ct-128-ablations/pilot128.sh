cd /work/main
B="env PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/s52/w128 --iterations 128 --per-epoch 8 --val-every 8"
for r in "$@"; do
  echo "round $r nnunet $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  $B --datasets spleen --trainers --nnunet-runs 1 > /tmp/s52/nn128-r$r.log 2>&1
  cp /tmp/s52/w128/spleen/nnunet_side.json /tmp/s52/nnunet128-spleen-r$r.json
  echo "round $r fv $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  $B --datasets spleen --reuse-nnunet --trainers nnunet --tag=-cl-r$r --set train.seed=$r \
     --set train.channels_last=true --set 'model.args.norm="instance_cl"' --json /tmp/s52/fv128-spleen-r$r.json > /tmp/s52/fv128-r$r.log 2>&1
done
echo "done $(date +%T)"
