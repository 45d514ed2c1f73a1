"""Each GPU lever of issue 40 beside its baseline, in one process, with every row's kernel table.

    python benchmarks/gpu_levers.py [--device cuda|cpu] [--quick] [--budget S] [--out DIR]

The rows (``ROWS`` below) are groups of one baseline and its levers, all at the baseline's batch and
precision unless the row says otherwise:

* 3-D U-Net (``unet3d-brats``, 4 x 128^3): NCDHW with the stock InstanceNorm (the first H200 run's
  setting) against NDHWC with the stock norm, NCDHW with ``norm: instance_cl``, NDHWC with it,
  NDHWC with it and ``up: shuffle``, and that with a conv bias before each norm (``bias: true``,
  what MLPerf drops), at fp16 and bf16; at fp16 also with the 4 MR channels padded to 8 for the first
  conv (``pad_in: 8``); batch 4 and 7 for the baseline and the NDHWC lever set.
* seed-001 U-Net (``unet2d-seed001``, 768 x 1024 x 16): NCHW against NHWC, NHWC with the
  transposed up-conv as 1x1 conv + pixel shuffle, with ``drop_bias``, and with the 1-channel image
  padded to 8 for the first conv (``pad_in: 8``), at bf16 and fp16.
* ResNet-50 (``resnet50-imagenet``, 256 x 224^2, NHWC fp16): the stem reading the RGB image padded to 4
  channels (``pad_in: 4``, MLPerf's input) against 3.
* compiled pairs last (``train.compile: true``): no row starts once ``--budget`` is spent.

Every row is built afresh by ``engine.build`` under the recipe's seed (the same initial weights),
warmed up, and timed over ``engine.train_step`` on a synthetic batch on the device (each timed step
ends with ``torch.cuda.synchronize``). Then a few more steps run under ``torch.profiler``: the top
kernels by self CUDA time and their share of it (``fastvision.profiling.top_ops``), and whether any
kernel is a cuDNN-less fallback (``slow_conv3d`` / ``vol2col``: PyTorch switches cuDNN off for some
fp16/bf16 NCDHW 3-D convolutions with cuDNN 9.8-9.14, pytorch #163581). Share of peak: the step's
FLOPs (plan's fake-tensor trace) x items/s against the device's dense peak (``planning.devices``).

Writes ``levers.json`` (the header: torch, CUDA, cuDNN, device; every row with its kernel table),
``levers.md`` (the table for benchmarks/RESULTS.md) and ``kernels.txt`` (each row's kernel table) to
``--out``. ``--device cpu --quick`` runs a few rows at CI sizes (tests/engine/test_gpu_suite.py).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

U3, S1, R50 = "unet3d-brats", "unet2d-seed001", "resnet50-imagenet"
CL_NORM = {"model.args.norm": "instance_cl"}
LEVERS3 = {**CL_NORM, "model.args.up": "shuffle"}
LEVERS2 = {"model.args.up": "shuffle", "model.args.drop_bias": True}
PAD8 = {"model.args.pad_in": 8}


def _row(group: str, name: str, recipe: str, batch: int, precision: str, cl: bool, sets: dict | None = None,
         base: str | None = None, compile: bool = False, quick: bool = False) -> dict[str, Any]:
    return dict(group=group, name=name, recipe=recipe, batch=batch, precision=precision, channels_last=cl,
                set=sets or {}, base=base, compile=compile, quick=quick)


def _unet3d_rows(p: str) -> list[dict[str, Any]]:
    """The layout / norm / up-conv levers at batch 2 and precision ``p``; at fp16 also the conv bias."""
    g, base, q = f"unet3d {p} bs2", f"unet3d NCDHW stock {p} bs2", p == "bf16"
    rows = [_row(g, base, U3, 2, p, False, quick=q),
            _row(g, f"unet3d NDHWC stock {p} bs2", U3, 2, p, True, base=base),
            _row(g, f"unet3d NCDHW instance_cl {p} bs2", U3, 2, p, False, CL_NORM, base),
            _row(g, f"unet3d NDHWC instance_cl {p} bs2", U3, 2, p, True, CL_NORM, base, quick=q),
            _row(g, f"unet3d NDHWC instance_cl+shuffle {p} bs2", U3, 2, p, True, LEVERS3, base)]
    if p == "fp16":
        lev = f"unet3d NDHWC instance_cl+shuffle {p} bs2"
        rows += [_row(g, "unet3d NDHWC instance_cl+shuffle+bias fp16 bs2", U3, 2, p, True,
                      {**LEVERS3, "model.args.bias": True}, lev),
                 _row(g, "unet3d NDHWC instance_cl+shuffle+pad_in8 fp16 bs2", U3, 2, p, True, {**LEVERS3, **PAD8},
                      lev)]
    return rows


def _unet3d_batch_rows() -> list[dict[str, Any]]:
    rows = []
    for bs in (4, 7):
        g, base = f"unet3d fp16 bs{bs}", f"unet3d NCDHW stock fp16 bs{bs}"
        rows += [_row(g, base, U3, bs, "fp16", False),
                 _row(g, f"unet3d NDHWC instance_cl+shuffle fp16 bs{bs}", U3, bs, "fp16", True, LEVERS3, base)]
    return rows


def _seed001_rows(p: str) -> list[dict[str, Any]]:
    if p == "fp16":
        g, base = "seed001 fp16 bs16", "seed001 NHWC fp16"
        return [_row(g, base, S1, 16, p, True),
                _row(g, "seed001 NHWC shuffle+drop_bias fp16", S1, 16, p, True, LEVERS2, base),
                _row(g, "seed001 NHWC shuffle+drop_bias+pad_in8 fp16", S1, 16, p, True, {**LEVERS2, **PAD8},
                     "seed001 NHWC shuffle+drop_bias fp16")]
    g, base = "seed001 bf16 bs16", "seed001 NCHW bf16"
    return [_row(g, base, S1, 16, p, False, quick=True),
            _row(g, "seed001 NHWC bf16", S1, 16, p, True, base=base),
            _row(g, "seed001 NHWC shuffle bf16", S1, 16, p, True, {"model.args.up": "shuffle"}, base, quick=True),
            _row(g, "seed001 NHWC shuffle+drop_bias bf16", S1, 16, p, True, LEVERS2, base),
            _row(g, "seed001 NHWC shuffle+drop_bias+pad_in8 bf16", S1, 16, p, True, {**LEVERS2, **PAD8},
                 "seed001 NHWC shuffle+drop_bias bf16")]


def _resnet50_rows() -> list[dict[str, Any]]:
    """The stem reading 4 channels (MLPerf's RGB + a zero channel) against 3, NHWC fp16 at batch 256."""
    g, base = "resnet50 fp16 bs256", "resnet50 NHWC fp16 bs256"
    return [_row(g, base, R50, 256, "fp16", True),
            _row(g, "resnet50 NHWC pad_in4 fp16 bs256", R50, 256, "fp16", True, {"model.args.pad_in": 4}, base)]


def _compiled_rows() -> list[dict[str, Any]]:
    g1, b1 = "seed001 compiled bf16 bs16", "seed001 NHWC compiled bf16"
    g2, b2 = "unet3d compiled fp16 bs2", "unet3d NCDHW stock compiled fp16 bs2"
    return [_row(g1, b1, S1, 16, "bf16", True, compile=True),
            _row(g1, "seed001 NHWC shuffle+drop_bias compiled bf16", S1, 16, "bf16", True, LEVERS2, b1, True),
            _row(g2, b2, U3, 2, "fp16", False, compile=True),
            _row(g2, "unet3d NDHWC instance_cl+shuffle compiled fp16 bs2", U3, 2, "fp16", True, LEVERS3, b2, True)]


# most telling first: a session's time guard cuts from the end
ROWS = (_unet3d_rows("fp16") + _seed001_rows("bf16") + _resnet50_rows() + _unet3d_batch_rows() + _unet3d_rows("bf16")
        + _seed001_rows("fp16") + _compiled_rows())
STEPS = dict(warmup=5, steps=15, profiled=3)
# CI sizes on a CPU: a few steps at tiny shapes, fp32 (bf16 convolutions crawl on a CPU)
CPU = {U3: dict(batch=1, set={"task.args.sample_shape": [4, 16, 16, 16], "model.args.filters": [4, 8, 16]}),
       S1: dict(batch=2, set={"task.args.sample_shape": [1, 64, 64]}),
       R50: dict(batch=2, set={"task.args.image_size": 64})}
CPU_STEPS = dict(warmup=1, steps=2, profiled=1)
FALLBACK = ("slow_conv3d", "vol2col", "col2vol", "slow_conv_dilated", "im2col")  # convolutions without cuDNN
GPU_BUDGET_S, CPU_BUDGET_S = 330.0, 60.0

log = logging.getLogger("gpu_levers")


def _config(row: dict[str, Any], device: torch.device):
    from fastvision import config
    from fastvision.benchmark.modes import setting_config

    sets, batch, precision = dict(row["set"]), row["batch"], row["precision"]
    if device.type == "cpu":
        sets, batch, precision = {**CPU[row["recipe"]]["set"], **sets}, CPU[row["recipe"]]["batch"], "fp32"
    cfg = config.load(row["recipe"], [config.nested(k, v) for k, v in sets.items()])
    return setting_config(cfg, batch, precision, compile=row["compile"], channels_last=row["channels_last"],
                          device=device), sets, batch, precision


def flops_per_item(cfg) -> float | None:
    """Matmul/conv FLOPs of one training step per item, from plan's fake-tensor trace at batch 1 (the
    levers change no convolution's FLOPs: one trace per recipe serves every row)."""
    from fastvision.planning import estimate

    try:
        return float(estimate.trace(cfg, 1, amp="off", channels_last=False).flops)
    except Exception as e:  # noqa: BLE001  (the share column is left empty, the row still measures)
        log.info("gpu_levers: no FLOP trace for %s (%s)", cfg.recipe, e)
        return None


def measure(row: dict[str, Any], device: torch.device, steps: dict[str, int]) -> dict[str, Any]:
    """Build, warm up, time and profile one row; its figures and kernel table."""
    from torch.profiler import ProfilerActivity, profile

    from fastvision import engine
    from fastvision.benchmark.report import step_stats
    from fastvision.profiling.profiler import top_ops

    cfg, sets, batch, precision = _config(row, device)
    if row["compile"]:
        torch._dynamo.reset()
    run = engine.build(cfg, data_info={}, train=True)
    cuda = device.type == "cuda"
    try:
        data = run.task.to_device(run.task.synthetic_batch(batch, device), device, row["channels_last"])
        batches = itertools.repeat(data)
        run.step.model.train()
        for _ in range(steps["warmup"]):
            engine.train_step(run.step, batches)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps["steps"]):
            t0 = time.perf_counter()
            engine.train_step(run.step, batches)
            if cuda:
                torch.cuda.synchronize(device)  # deliberate: a step ends when the GPU is done
            times.append(time.perf_counter() - t0)
        out = {"settings": {"batch": batch, "precision": precision, "overrides": sets}, **step_stats(times, batch)}
        if cuda:
            out["peak_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        try:  # the kernel table: a profiler failure (no CUPTI) keeps the row's timing
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                for _ in range(steps["profiled"]):
                    engine.train_step(run.step, batches)
                if cuda:
                    torch.cuda.synchronize(device)
            out["kernels"] = top_ops(prof, device, steps["profiled"], n=15)
            if cuda:  # on a CPU slow_conv3d is the ordinary 3-D convolution: only a GPU's fallback is news
                out["fallback_kernels"] = sorted({e.key for e in prof.key_averages()
                                                  if any(f in e.key.lower() for f in FALLBACK)})
        except Exception as e:  # noqa: BLE001
            out["kernels_error"] = f"{type(e).__name__}: {e}"[:200]
        return out
    finally:
        del run
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def peak_tflops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    from fastvision.planning.devices import local_gpu

    return local_gpu(device.index).peak_tflops(precision)[0]


def run_levers(device: torch.device, quick: bool, budget: float | None = None,
               out: Path | None = None) -> dict[str, Any]:
    """Every selected row in order, each timed; no row starts after ``budget`` seconds. With ``out``
    the files are rewritten after every row, so a run stopped from outside keeps what it measured."""
    budget = budget if budget is not None else CPU_BUDGET_S if device.type == "cpu" else GPU_BUDGET_S
    steps = CPU_STEPS if device.type == "cpu" else STEPS
    start, rows, flops = time.perf_counter(), [], {}
    for spec in ROWS:
        row = {k: spec[k] for k in ("group", "name", "recipe", "base", "channels_last", "compile")}
        t0 = time.perf_counter()
        if quick and not spec["quick"]:
            row["skip"] = "not in --quick"
        elif t0 - start > budget:
            row["skip"] = f"time budget ({budget:.0f} s) spent"
        else:
            log.info("gpu_levers: %s", spec["name"])
            try:
                row.update(measure(spec, device, steps))
                if spec["recipe"] not in flops:
                    flops[spec["recipe"]] = flops_per_item(_config(spec, device)[0])
                row["flops_per_item"] = flops[spec["recipe"]]
            except Exception as e:  # one failing row must not hide the others' figures
                row["error"] = f"{type(e).__name__}: {e}"[:300]
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        if out is not None:
            write(report(device, quick, steps, start, rows), out)
    return report(device, quick, steps, start, rows)


def report(device: torch.device, quick: bool, steps: dict[str, int], start: float,
           rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON: the header (versions, device) and the rows with their ratio to the group's baseline
    and their share of the device's dense peak."""
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        base = by_name.get(r["base"]) if r["base"] else None
        if base and "items_per_s" in r and "items_per_s" in base:
            r["vs_base"] = r["items_per_s"] / base["items_per_s"]
        peak = peak_tflops(device, r["settings"]["precision"]) if "settings" in r else None
        if peak and r.get("flops_per_item") and "items_per_s" in r:
            r["share_of_peak"] = r["flops_per_item"] * r["items_per_s"] / (peak * 1e12)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"suite": "gpu_levers", "issue": 40, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "cudnn_enabled": torch.backends.cudnn.enabled, "quick": quick, "steps": steps,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.perf_counter() - start, 1),
            "command": "python benchmarks/gpu_levers.py " + " ".join(sys.argv[1:]), "rows": rows}


HEAD = ["group", "setting", "items/s", "x baseline", "p50 ms", "share of peak", "peak MB", "top kernel (share)",
        "note"]


def _cells(r: dict[str, Any]) -> list[str]:
    k = r.get("kernels") or []
    top = f"{k[0]['name'][:60]} ({k[0]['share']:.0%})" if k else ""
    note = (f"FAILED: {r['error']}" if "error" in r else f"skipped: {r['skip']}" if "skip" in r else
            ("cuDNN-less kernels: " + ", ".join(r["fallback_kernels"])[:120]) if r.get("fallback_kernels") else
            f"no kernel table: {r['kernels_error']}" if "kernels_error" in r else "")
    return [r["group"], r["name"] + (" (baseline)" if not r["base"] else ""),
            f"{r['items_per_s']:,.1f}" if "items_per_s" in r else "-",
            f"{r['vs_base']:.2f}" if "vs_base" in r else "", f"{r['latency_p50_ms']:.1f}" if "items_per_s" in r else "",
            f"{r['share_of_peak']:.1%}" if "share_of_peak" in r else "",
            f"{r['peak_memory_mb']:,.0f}" if "peak_memory_mb" in r else "", top, note]


def markdown(report: dict[str, Any]) -> str:
    where = report["gpu"] or report["device"]
    lines = [f"**fastvision GPU levers on {where}, torch {report['torch']}, CUDA {report['cuda']}, cuDNN "
             f"{report['cudnn']}, {report['date']}, {report['seconds']} s**", "",
             f"Command: `{report['command']}`", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in report["rows"]]
    return "\n".join(lines) + "\n"


def kernel_text(report: dict[str, Any]) -> str:
    """Each measured row's kernel table: ms per step, calls per step, share of the profiled self time."""
    out = []
    for r in report["rows"]:
        if not r.get("kernels"):
            continue
        out.append(f"== {r['name']}: {r.get('items_per_s', 0):,.1f} items/s, p50 {r.get('latency_p50_ms', 0):.1f} ms")
        out += [f"  {k['share']:6.1%} {k['ms_per_step']:9.3f} ms {k['calls_per_step']:7.1f}x  {k['name'][:150]}"
                for k in r["kernels"]]
    return "\n".join(out) + "\n"


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "levers.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "levers.md").write_text(markdown(result))
    (out / "kernels.txt").write_text(kernel_text(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few rows: one baseline and lever per model")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cuda, cuda:N or cpu (CI sizes)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds after which no row starts (default {GPU_BUDGET_S:.0f} on a GPU, "
                        f"{CPU_BUDGET_S:.0f} on a CPU)")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_levers"), help="folder for the JSON, MD and kernels")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from benchmarks.gpu_suite import resolve_device

    device = resolve_device(args.device)
    result = run_levers(device, args.quick, args.budget, args.out)
    write(result, args.out)
    print(markdown(result))
    print(f"wrote {args.out / 'levers.json'}, levers.md and kernels.txt")
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
