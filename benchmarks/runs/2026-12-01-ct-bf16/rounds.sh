#!/usr/bin/env bash
# Paired rounds at 64 iterations on a CPU with AVX-512 BF16: nnU-Net once, then fastvision's configured recipe in
# NDHWC + instance_cl (train.seed=r) in fp32 and with train.amp=bf16, the two fastvision sides in alternating order;
# every validation scored as nnU-Net scores its own (score_as_nnunet).
# DS: spleen (CT, the default), hippocampus (MR) or prostate (anisotropic MR); O: the output folder; TAG: a prefix of the
# run folders' tags; W: train_vs_nnunet.py's --work (default /tmp/s53/w).
# Runs of 2026-12-01: this folder `rounds.sh 0`, `rounds.sh 1 ... 11`; ../2026-12-01-ct-norm:
# `O=/tmp/s53/r64n TAG=n rounds.sh 0 ... 7` and `... 8 9 10 11`; its mr/: `DS=hippocampus O=/tmp/s53/mr TAG=n rounds.sh 0 1 2 3`
# and, on 2026-12-02, `DS=hippocampus O=/tmp/s54/mr TAG=n rounds.sh 4 ... 11`; ../2026-12-02-ct-sum: `O=/tmp/s54/ct TAG=s rounds.sh 0 ... 11`
cd /work/main
DS=${DS:-spleen} O=${O:-/tmp/s53/r64} TAG=${TAG:-} W=${W:-/tmp/s53/w}
B="env PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work $W --iterations 64 --per-epoch 8 --val-every 8"
fv() {  # round, precision name, amp value
  $B --datasets $DS --reuse-nnunet --trainers nnunet --tag=-$TAG$2-r$1 --set train.seed=$1 \
     --set train.channels_last=true --set 'model.args.norm="instance_cl"' --set "train.amp=\"$3\"" \
     --json $O/fv$2-$DS-r$1.json > $O/fv$2-r$1.log 2>&1
  tail -1 $O/fv$2-r$1.log
}
for r in "$@"; do
  echo "round $r nnunet $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  $B --datasets $DS --trainers --nnunet-runs 1 > $O/nn-r$r.log 2>&1
  cp $W/$DS/nnunet_side.json $O/nnunet-$DS-r$r.json
  tail -1 $O/nn-r$r.log
  if (( r % 2 == 0 )); then order="fp32:off bf16:bf16"; else order="bf16:bf16 fp32:off"; fi
  for s in $order; do
    echo "round $r fv ${s%%:*} $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    fv $r ${s%%:*} ${s##*:}
  done
done
echo "done $(date +%T)"
