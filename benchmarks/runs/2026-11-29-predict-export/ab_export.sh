#!/usr/bin/env bash
# predict's export, nearest labels (664669b) against linear probabilities (head), the same checkpoint and 20 images, interleaved
# needs a worktree of the code before the change: git worktree add /tmp/s52/old 664669b; and /tmp/s52/pvn from
# benchmarks/predict_vs_nnunet.py --work /tmp/s52/pvn (its run-whole checkpoint and test images)
IMG=/tmp/s52/pvn/Task09_Spleen/imagesTs; CK=/tmp/s52/pvn/run-whole
for r in 1 2 3 4; do
  for side in old new; do
    if [ $side = old ]; then cd /tmp/s52/old; else cd /work/main; fi
    s=$(date +%s.%N); OMP_NUM_THREADS=2 PYTHONPATH=$PWD /work/main/.venv/bin/python -m fastvision predict $CK $IMG --out /tmp/s52/ab-$side --force --postprocess none > /dev/null 2>&1
    e=$(date +%s.%N); echo "$r $side $(echo "$e - $s" | bc)"
  done
done
