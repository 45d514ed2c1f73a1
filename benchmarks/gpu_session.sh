#!/usr/bin/env bash
# One device call for a lent GPU (issues 40, 41, 23, 31), most valuable first, each part under a time guard:
# 1. the levers of issue 40 beside their baselines (benchmarks/gpu_levers.py: the 3-D U-Net in NCDHW vs NDHWC
#    with the layout-keeping norm, the shuffle up-conv, the conv bias, fp16 vs bf16, batch 2/4/7; seed-001 NCHW
#    vs NHWC, transposed vs shuffle up-conv, drop_bias; compiled pairs), each row with its kernel table;
# 2. the two data-wait measurements inside training that no CPU can give (issue 40's spleen `data.cache: gpu`
#    row; issue 41 item 3: the recipe `configure --trainer nnunet` writes for this GPU, nnU-Net's augmentation
#    as batched device ops): about 2-3 minutes, before the tests because two issues wait on them;
# 3. the GPU tests (the suite's last row alone: its other rows measure what no change since the first run
#    touched); 4. what the first run left open (JPEG decode, compiled fp16, SSD NHWC, tune), as time allows.
#
#   bash benchmarks/gpu_session.sh            # on the GPU machine, in the repo root; writes to $OUT
#
# Carry .whl (monai, nibabel, pycocotools wheels for cp312: `bash scripts/gpu_wheels.sh` here first): the spleen stages
# write NIfTI. GPU_SESSION_S (default 540) is the wall-clock the script plans for. The levers get
# LEVERS_S (default 200: no row starts after it) and are stopped when less than DATA_RESERVE_S (default 160)
# + TESTS_RESERVE_S (default 140) is left; the data-wait stages then run, the tests get what is left, the
# stages after them what remains, each skipped when less than it needs is left (with the defaults parts 1-3
# fill the call: SKIP_TESTS=1 leaves time for part 4, or run a second call with SKIP_LEVERS=1 SKIP_DATA=1).
# SKIP_LEVERS=1 / SKIP_DATA=1 / SKIP_TESTS=1 skip those parts; FULL_SUITE=1 runs every suite row instead of
# the tests alone. A machine start took 30-75 s on the H200: give the call timeout_s 570.
# Results (at most 8 files come back): $OUT/versions.txt; $OUT/levers/{levers.json,levers.md,kernels.txt};
# $OUT/suite/gpu_suite.{json,md}; $OUT/extra.tar.gz (benchmark JSONs, profiles, tune tables).
set -u
start=$(date +%s)
limit=${GPU_SESSION_S:-540}
reserve=${SESSION_RESERVE_S:-30}
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
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1
  python3 -c "import torch, os; c = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name() if c else 'no cuda', \
'cpus', os.cpu_count())"; } 2>&1 | tee "$out/versions.txt"

# 1. issue 40: each lever beside its baseline, in one process, with every row's kernel table
if [ "${SKIP_LEVERS:-0}" != 1 ]; then
  say "gpu_levers (budget ${LEVERS_S:-200} s)"
  timeout $(($(left) - ${DATA_RESERVE_S:-160} - ${TESTS_RESERVE_S:-140})) python3 benchmarks/gpu_levers.py \
    --device "$dev" --budget "${LEVERS_S:-200}" --out "$out/levers" 2>&1 | grep -v "^gpu_levers: \|^benchmark \|^USDT"
  say "gpu_levers exit ${PIPESTATUS[0]}"
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
# 2. the spleen recipe's data wait inside training, with the GPU cache (goal: < 5 % of the step)
if [ "${SKIP_DATA:-0}" != 1 ] && [ "$(left)" -gt 90 ]; then
  python3 -m fastvision data synth spleen /tmp/spleen --cases 12 --size 160 >/dev/null 2>&1 || say "spleen synth failed"
  stage "profile spleen-gpu-cache" 80 python3 -m fastvision profile unet3d-spleen-fast --data /tmp/spleen \
    --device "$dev" --steps 30 --warmup 10 --set data.cache=gpu --out /tmp/extra/profile-spleen-gpu
fi
# 2b. issue 41 item 3 on the GPU: the recipe `configure --trainer nnunet` writes for this GPU (nnU-Net's
#     augmentation as batched device ops, its batch), profiled: data wait and augmentation vs the step (< 5 %)
if [ "${SKIP_DATA:-0}" != 1 ] && [ -d /tmp/spleen ]; then
  stage "configure nnunet spleen" 60 python3 -m fastvision configure /tmp/spleen --trainer nnunet \
    --out /tmp/extra/nnunet-spleen.yaml --force
  [ -f /tmp/extra/nnunet-spleen.yaml ] && stage "profile nnunet-configured" 70 python3 -m fastvision profile \
    /tmp/extra/nnunet-spleen.yaml --device "$dev" --steps 30 --warmup 10 --out /tmp/extra/profile-nnunet-spleen
fi
# 3. the GPU tests (the suite's last row; FULL_SUITE=1: every row)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  only=(--only "GPU tests"); [ "${FULL_SUITE:-0}" = 1 ] && only=()
  say "gpu_suite ${only[*]} (budget $(($(left) - reserve)) s)"
  timeout $(($(left) - 10)) python3 benchmarks/gpu_suite.py --device "$dev" --budget $(($(left) - reserve)) \
    "${only[@]}" --out "$out/suite" 2>&1 | grep -v "^benchmark \|^gpu_suite: "
  say "gpu_suite exit ${PIPESTATUS[0]}"
fi

# 4. train.augment_rng: sample beside rank on the device (host-hashed draws, per-sample noise generators; ~20 s)
stage "augment_rng" 40 python3 benchmarks/augment_rng.py --device "$dev" --rounds 5 --calls 10 \
  --json /tmp/extra/augment_rng.json
# 4'. data.num_workers: auto on this 16-core host against the recipe's 2 and DLE's 8, ResNet-50's JPEG input path
#     alone (benchmark --mode data: the question helper-measured defaults wait on; ~1 minute)
if python3 -m fastvision data synth imagenet /tmp/inet-w --classes 4 --per-class 64 --val-per-class 4 --size 224 \
    >/dev/null 2>&1; then
  for w in 2 auto 8; do
    stage "data workers $w" 30 python3 -m fastvision benchmark resnet50-imagenet --mode data --data /tmp/inet-w \
      --device "$dev" --steps 16 --rounds 2 --batch-sizes 64 --set data.num_workers=$w --set data.loader=processes \
      --out "/tmp/extra/data-workers-$w"
  done
fi
# 4. ResNet-50 from JPEG files: Pillow on the host vs nvJPEG on the GPU (issue 40 item 7; about 3 minutes)
if [ -f benchmarks/jpeg_gpu_decode.py ]; then
  stage "jpeg gpu decode" 200 python3 benchmarks/jpeg_gpu_decode.py --out /tmp/extra/jpeg_gpu_decode.json
fi
# 4a. ResNet-50: compile and fp16 together (eager fp16 1.29x bf16, compile 1.37x eager: the 8,000 goal)
bench rn50-compiled 150 resnet50-imagenet --batch-sizes 256 --precision bf16,fp16 --compile
# 4b. SSD320 in NHWC at both precisions and two batches (NHWC 1,053 vs NCHW 910-944 at 64, bf16)
bench ssd-nhwc 60 ssd320-coco --batch-sizes 64,128 --precision bf16,fp16 --channels-last \
  --set model.args.pretrained=null
# 5. the tuner (needs the spleen data of part 2) on the spleen recipe (its verdict, trials and tuned.yaml)
if [ -d /tmp/spleen ]; then
  stage "tune spleen" 150 python3 -m fastvision tune unet3d-spleen-fast --data /tmp/spleen --device "$dev" \
    --budget "$(($(left) - 30))s" --out /tmp/extra/tune-spleen/tuned.yaml --json /tmp/extra/tune-spleen/trials.json
fi
pack
say "done"
