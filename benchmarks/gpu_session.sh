#!/usr/bin/env bash
# One device call for a lent GPU (issues 23 / 31): the suite (its last row runs the GPU tests), then the
# measurements the last GPU run left open, most valuable first, each under a time guard so the whole
# fits one call. The first run (H200, 2026-11-26, benchmarks/RESULTS.md) measured eager bf16/fp16 and
# the profiles; what it left: compile with fp16, SSD320 in NHWC at both precisions, the 3-D U-Net
# compiled and in channels_last_3d, the spleen recipe's data wait inside training, and the tuner.
#
#   bash benchmarks/gpu_session.sh            # on the GPU machine, in the repo root; writes to $OUT
#
# Carry .whl (monai, nibabel, pycocotools wheels for cp312, see the device README): the spleen stage
# writes NIfTI. GPU_SESSION_S (default 540) is the wall-clock the script plans for; no suite row starts
# after all but SESSION_RESERVE_S (default 240) of it, the stages after it get what is left, and each
# stage is skipped when less than it needs is left. SKIP_SUITE=1 skips the suite. On the H200 the suite
# took 292 s (its pytest row 145 s of it) and a machine start 30-75 s: give the call timeout_s 570.
# Results: $OUT/suite/gpu_suite.{json,md}, $OUT/extra.tar.gz (benchmark JSONs, profiles, tune tables).
set -u
start=$(date +%s)
limit=${GPU_SESSION_S:-540}
reserve=${SESSION_RESERVE_S:-240}
out=${OUT:-runs/gpu_session}
dev=${DEVICE:-cuda}
mkdir -p "$out/suite" /tmp/extra
left() { echo $((limit - ($(date +%s) - start))); }
say() { echo "[$(($(date +%s) - start)) s] $*"; }
pack() { tar -czf "$out/extra.tar.gz" -C /tmp extra 2>/dev/null; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1
python3 -c "import torch, os; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda', 'cpus', os.cpu_count())"

if [ "${SKIP_SUITE:-0}" != 1 ]; then
  say "gpu_suite (budget $(($(left) - reserve)) s)"
  timeout $(($(left) - 30)) python3 benchmarks/gpu_suite.py --device "$dev" --budget $(($(left) - reserve)) \
    --out "$out/suite" 2>&1 | grep -v "^benchmark \|^gpu_suite: "
  say "gpu_suite exit ${PIPESTATUS[0]}"
fi

stage() {  # NAME MIN_SECONDS command...: run when MIN_SECONDS are left, stopped 10 s before the end
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then say "skip $name: $(left) s left, needs $need"; return; fi
  say "$name"
  timeout $(($(left) - 10)) "$@" 2>&1 | tail -14
  pack
}
bench() {  # NAME MIN_SECONDS recipe args...: fastvision benchmark into /tmp/extra/NAME
  local name=$1 need=$2; shift 2
  stage "bench $name" "$need" python3 -m fastvision benchmark "$@" --device "$dev" --steps 20 --warmup 8 \
    --out "/tmp/extra/$name" --force
}
# 1. ResNet-50: compile and fp16 together (eager fp16 1.29x bf16, compile 1.37x eager: the 7,000 goal)
bench rn50-compiled 150 resnet50-imagenet --batch-sizes 256 --precision bf16,fp16 --compile
# 2. SSD320 in NHWC at both precisions and two batches (NHWC 1,053 vs NCHW 910-944 at 64, bf16)
bench ssd-nhwc 60 ssd320-coco --batch-sizes 64,128 --precision bf16,fp16 --channels-last \
  --set model.args.pretrained=null
# 3. 3-D U-Net: channels_last_3d eager, then compiled (eager 25.6 bf16 / 31.0 fp16 vol/s at 2)
bench unet3d-ndhwc 45 unet3d-brats --batch-sizes 2 --precision bf16,fp16 --channels-last
bench unet3d-compiled 150 unet3d-brats --batch-sizes 2 --precision bf16,fp16 --compile
# 3b. which kernels the seed-001 U-Net's step is (1.8 % of peak on the H200): profile's top-kernel table
stage "profile seed001 kernels" 40 python3 -m fastvision profile unet2d-seed001 --synthetic --device "$dev" --amp bf16 \
  --set train.channels_last=true --steps 10 --warmup 5 --trace /tmp/trace-seed001 --out /tmp/extra/profile-seed001-trace
# 4. the spleen recipe's data wait inside training, with the GPU cache (goal: < 5 % of the step)
if [ "$(left)" -gt 90 ]; then
  python3 -m fastvision data synth spleen /tmp/spleen --cases 12 --size 160 >/dev/null 2>&1 || say "spleen synth failed"
  stage "profile spleen-gpu-cache" 80 python3 -m fastvision profile unet3d-spleen-fast --data /tmp/spleen \
    --device "$dev" --steps 30 --warmup 10 --set data.cache=gpu --out /tmp/extra/profile-spleen-gpu
fi
# 5. the tuner on the spleen recipe (its verdict, trials and tuned.yaml)
if [ -d /tmp/spleen ]; then
  stage "tune spleen" 150 python3 -m fastvision tune unet3d-spleen-fast --data /tmp/spleen --device "$dev" \
    --budget "$(($(left) - 30))s" --out /tmp/extra/tune-spleen/tuned.yaml --json /tmp/extra/tune-spleen/trials.json
fi
pack
say "done"
