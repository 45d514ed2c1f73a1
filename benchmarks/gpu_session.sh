#!/usr/bin/env bash
# One device call for a lent GPU (issues 23 / 31): the suite, the GPU tests, then profiles and benchmark
# variants of the goal workloads, each under a time guard so the whole fits one call.
#
#   bash benchmarks/gpu_session.sh            # on the GPU machine, in the repo root; writes to $OUT
#
# Carry .whl (monai, nibabel, pycocotools wheels for cp312, see the device README) so that the GPU
# tests collect as they do here. GPU_SESSION_S (default 420) is the wall-clock the script plans for;
# the suite gets all but SESSION_RESERVE_S (default 150) of it, the extras what is left.
# Results: $OUT/suite/gpu_suite.{json,md}, $OUT/session.log, $OUT/extra.tar.gz (profiles, benchmarks).
set -u
start=$(date +%s)
limit=${GPU_SESSION_S:-420}
reserve=${SESSION_RESERVE_S:-150}
out=${OUT:-runs/gpu_session}
mkdir -p "$out/suite" /tmp/extra
left() { echo $((limit - ($(date +%s) - start))); }
say() { echo "[$(($(date +%s) - start)) s] $*"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
fv() { python3 -m fastvision "$@"; }
pack() { tar -czf "$out/extra.tar.gz" -C /tmp extra 2>/dev/null; }

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
python3 -c "import torch, os; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), 'cpus', os.cpu_count())"

say "gpu_suite (budget $(($(left) - reserve)) s)"
timeout $(($(left) - 30)) python3 benchmarks/gpu_suite.py --budget $(($(left) - reserve)) --out "$out/suite"
say "gpu_suite exit $?"

# Profiles: the verdict and the time per phase of each goal workload's training step on synthetic batches.
profile() {  # name recipe args...
  local name=$1; shift
  if [ "$(left)" -lt 40 ]; then say "skip profile $name: $(left) s left"; return; fi
  say "profile $name"
  timeout $(($(left) - 10)) python3 -m fastvision profile "$@" --synthetic --device "${DEVICE:-cuda}" --steps 20 --warmup 10 \
    --out "/tmp/extra/profile-$name" 2>&1 | tail -25
  pack
}
profile rn50 resnet50-imagenet --amp bf16
profile unet3d unet3d-brats --amp bf16 --batch-size 2
profile ssd320 ssd320-coco --amp bf16 --batch-size 64 --set model.args.pretrained=null
profile seed001 unet2d-seed001 --amp bf16 --set train.channels_last=true

# Benchmark variants: the levers of the goal table, side by side in one process each.
bench() {  # name recipe args...
  local name=$1; shift
  if [ "$(left)" -lt 45 ]; then say "skip bench $name: $(left) s left"; return; fi
  say "bench $name"
  timeout $(($(left) - 10)) python3 -m fastvision benchmark "$@" --device "${DEVICE:-cuda}" --steps 20 --warmup 8 \
    --out "/tmp/extra/bench-$name" --force 2>&1 | tail -12
  pack
}
bench rn50-batch resnet50-imagenet --batch-sizes 128,256,384 --precision bf16,fp16
bench unet3d-prec unet3d-brats --batch-sizes 2,4 --precision bf16,fp16
bench ssd-batch ssd320-coco --batch-sizes 64,128 --precision bf16 --set model.args.pretrained=null
pack
say "done"
