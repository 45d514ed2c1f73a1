#!/usr/bin/env bash
cd /work/main
B="env PYTHONPATH=$PWD .venv/bin/python benchmarks/train_vs_nnunet.py --work /tmp/s52/w128 --iterations 128 --per-epoch 8 --val-every 8 --datasets spleen --reuse-nnunet --trainers nnunet"
CL="--set train.channels_last=true --set model.args.norm=\"instance_cl\""
run() { name=$1; shift; echo "$name $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; $B --tag=-$name "$@" --json /tmp/s52/abl-$name.json > /tmp/s52/abl-$name.log 2>&1; tail -1 /tmp/s52/abl-$name.log; }
for v in "$@"; do
case $v in
  noaffine) run noaffine --set train.seed=0 $CL --set "data.augment=$(cat /tmp/s52/aug_noaffine.json)";;
  he) run he --set train.seed=0 $CL --set 'model.args.init="he"';;
  ncdhw) run ncdhw --set train.seed=0;;
  noaug) run noaug --set train.seed=0 $CL --set 'data.augment={"flip": {"prob": 0.5, "axes": [0, 1, 2]}}';;
  noaffine2) run noaffine2 --set train.seed=0 $CL --set data.augment.affine.prob=0.0 --set data.augment.affine.rotate_prob=0.0 --set data.augment.affine.zoom_prob=0.0;;
  lablin) (export FV_LABEL_LINEAR=1; run lablin --set train.seed=0 $CL);;
  noaug2s1) run noaug2s1 --set train.seed=1 $CL --set data.augment.affine.prob=0.0 --set data.augment.affine.rotate_prob=0.0 --set data.augment.affine.zoom_prob=0.0 --set data.augment.noise.prob=0.0 --set data.augment.brightness.prob=0.0 --set data.augment.contrast.prob=0.0 --set data.augment.gamma.prob=0.0 --set data.augment.blur.prob=0.0 --set data.augment.lowres.prob=0.0 --set data.augment.gamma_inverted.prob=0.0;;
  noaug2s2) run noaug2s2 --set train.seed=2 $CL --set data.augment.affine.prob=0.0 --set data.augment.affine.rotate_prob=0.0 --set data.augment.affine.zoom_prob=0.0 --set data.augment.noise.prob=0.0 --set data.augment.brightness.prob=0.0 --set data.augment.contrast.prob=0.0 --set data.augment.gamma.prob=0.0 --set data.augment.blur.prob=0.0 --set data.augment.lowres.prob=0.0 --set data.augment.gamma_inverted.prob=0.0;;
  noaug2) run noaug2 --set train.seed=0 $CL --set data.augment.affine.prob=0.0 --set data.augment.affine.rotate_prob=0.0 --set data.augment.affine.zoom_prob=0.0 --set data.augment.noise.prob=0.0 --set data.augment.brightness.prob=0.0 --set data.augment.contrast.prob=0.0 --set data.augment.gamma.prob=0.0 --set data.augment.blur.prob=0.0 --set data.augment.lowres.prob=0.0 --set data.augment.gamma_inverted.prob=0.0;;
  nointens) run nointens --set train.seed=0 $CL --set data.augment.brightness.prob=0.0 --set data.augment.contrast.prob=0.0 --set data.augment.gamma.prob=0.0 --set data.augment.gamma_inverted.prob=0.0;;
  nodegr) run nodegr --set train.seed=0 $CL --set data.augment.noise.prob=0.0 --set data.augment.blur.prob=0.0 --set data.augment.lowres.prob=0.0;;
  prep) (export FV_CUBIC=1 FV_NORM_FIRST=1; run prep --set train.seed=0 $CL);;
  preplin) (export FV_CUBIC=1 FV_NORM_FIRST=1 FV_LABEL_LINEAR=1; run preplin --set train.seed=0 $CL);;
  *) echo unknown $v;;
esac
done
echo "done $(date +%T)"
