"""``fastvision tune`` against its start and a brute-force grid, end to end with ``fastvision train``.

For each recipe (on generated data, at reduced sizes for a shared 2-core CPU) and each start,
(a) the recipe and (b) a naive configuration (``data.cache: none``, ``data.num_workers: 0``,
``train.channels_last: false``), ``fastvision tune`` runs with ``--budget``. Then every point of
a grid over the same switches (cache none/ram x workers 0/2; both starts
are grid points unless the recipe's cache is another tier, which is then added) and both tuned
recipes train end to end in ``--rounds`` interleaved rounds (order rotated each round). Throughput
is items per second of ``fit``'s wall time (build, cache fill, loaders, every epoch, validation):
the same items for every configuration of a recipe, so the ratios are ratios of wall times. Every run gets a fresh
``FASTVISION_CACHE`` (cold caches, as a first run would have).

    OMP_NUM_THREADS=1 python benchmarks/tune.py [--budget 120s] [--rounds 2] [--out /tmp/h27-tune/bench]
    OMP_NUM_THREADS=1 python benchmarks/tune.py --confirm 4 --out /tmp/h27-tune/bench   # the key rows again
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAIVE = ["data.cache=none", "data.num_workers=0", "train.channels_last=false"]
GRID = {"data.cache": ["none", "ram"], "data.num_workers": [0, 2]}
# switches the grid does not cover are pinned in tune too, so both search the same switches (time:
# compile costs 20-60 s a build here, and every grid point is two end-to-end runs)
KEEP = ["data.loader", "train.compile", "train.amp", "train.cpu_threads", "train.channels_last",
        "model.args.norm", "model.args.up", "model.args.drop_bias"]
COMMON = ["examples=0", "train.val_every=100", "train.target=null", "train.log_every=50"]

SPLEEN = ["data.args.patch_size=[32,32,32]", "task.args.sample_shape=[1,32,32,32]",
          "task.args.sliding_window.roi_size=[32,32,32]", "model.args.filters=[8,16,32,64,128]",
          "train.amp=off", "train.batch_size=2", "data.args.num_folds=3"]
RECIPES = {  # label: recipe, synth kind and options, reductions (--set) for a shared 2-core CPU, epochs
    "unet2d-microscopy": ("unet2d-microscopy", "microscopy", ["--count", "160", "--size", "64"],
                          ["data.args.image_size=[64,64]", "train.batch_size=8"], 2),
    "unet3d-spleen-fast": ("unet3d-spleen-fast", "spleen", ["--cases", "12", "--size", "48"], SPLEEN, 4),
    "resnet18-imagefolder": ("resnet18-imagefolder", "imagenet",
                             ["--classes", "4", "--per-class", "96", "--val-per-class", "4"],
                             ["task.args.num_classes=4", "model.args.num_classes=4", "train.batch_size=32"], 2),
    "ssd320-small-shapes": ("ssd320-small-shapes", "coco", ["--train", "64", "--val", "8"], ["train.batch_size=8"], 2),
    # input-bound variant: 96^3 generated cases, so resampling every item costs more than the step
    "unet3d-spleen-fast-96": ("unet3d-spleen-fast", "spleen", ["--cases", "12", "--size", "96"], SPLEEN, 4),
}


def fv(*args: str, env: dict | None = None, log: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fastvision", *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}\n")
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed: {res.stderr[-1500:]}")
    return res


def sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def train(config: str, data: Path, extra: list[str], epochs: int, work: Path, log: Path) -> float:
    """One end-to-end ``fastvision train``: fit's wall seconds (fresh FASTVISION_CACHE)."""
    out = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    env = {**os.environ, "FASTVISION_CACHE": tempfile.mkdtemp(dir=work, prefix="cache-")}
    fv("train", config, "--data", str(data), "--device", "cpu", "--epochs", str(epochs), "--out", str(out / "r"),
       *sets(extra + COMMON), env=env, log=log)
    return json.loads((out / "r" / "summary.json").read_text())["wall_time_s"]


def _point_name(point: dict) -> str:
    return "grid " + ",".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())


def start_point(recipe: str, extra: list[str]) -> dict:
    """The grid switches' values in the recipe with ``extra`` applied."""
    from fastvision import config

    cfg = config.load(recipe, [config.parse_override(s) for s in extra])
    return {"data.cache": cfg.data.cache, "data.num_workers": cfg.data.num_workers}


def interleave(recipe: str, configs: dict, rounds: int, data: Path, epochs: int, work: Path,
               log: Path) -> dict[str, list[float]]:
    """Every configuration trained end to end once per round, the order rotated each round."""
    walls: dict[str, list[float]] = {k: [] for k in configs}
    names = list(configs)
    for r in range(rounds):
        shift = r * len(names) // max(1, rounds)  # no configuration always first
        for name in names[shift:] + names[:shift]:
            cfg, extra = configs[name]
            walls[name].append(train(cfg, data, extra, epochs, work, log))
            print(f"{recipe} round {r} {name}: {walls[name][-1]:.1f} s", flush=True)
    return walls


def confirm(args, log: Path) -> None:
    """``--confirm N``: the starts, the tuned recipes and the grid's best of an earlier run's
    results.json, again in N interleaved rounds (the grid pass gives each point few rounds)."""
    rows = []
    for r in json.loads((args.out / "results.json").read_text()):
        if "error" in r:
            continue
        label = r["recipe"]
        recipe, _, _, reduce, epochs = RECIPES[label]
        keys = {r["starts"]["a"], r["starts"]["b"], r["grid_best"]}
        configs = {}
        for key in sorted(keys):
            if key.startswith("grid "):
                point = dict(kv.split("=") for kv in key[5:].split(","))
                configs[key] = (recipe, reduce + [f"data.cache={point['cache']}",
                                                  f"data.num_workers={point['num_workers']}"])
            else:
                configs[key] = (recipe, reduce)
        for n in "ab":
            configs[f"tuned ({n})"] = (str(args.out / f"tuned-{label}-{n}.yaml"), [])
        walls = interleave(label, configs, args.confirm, args.out / f"data-{label}", epochs, args.out, log)
        med = {k: statistics.median(v) for k, v in walls.items()}
        best = r["grid_best"]
        rows.append({"recipe": label, "wall_s": walls, "median_wall_s": med, "starts": r["starts"], "grid_best": best,
                     "tuned_a_vs_start_a": med[r["starts"]["a"]] / med["tuned (a)"],
                     "tuned_b_vs_start_b": med[r["starts"]["b"]] / med["tuned (b)"],
                     "tuned_a_vs_grid_best": med[best] / med["tuned (a)"],
                     "tuned_b_vs_grid_best": med[best] / med["tuned (b)"],
                     "tuned": r["tuned"]})
        (args.out / "confirm.json").write_text(json.dumps(rows, indent=2))
    report(rows)


def one_recipe(label: str, args, work: Path, log: Path) -> dict:
    recipe, kind, synth_opts, reduce, epochs = RECIPES[label]
    data = work / f"data-{label}"
    if not data.exists():
        fv("data", "synth", kind, str(data), *synth_opts, log=log)
    configs: dict[str, tuple[str, list[str]]] = {}
    for values in itertools.product(*GRID.values()):
        point = dict(zip(GRID, values, strict=True))
        configs[_point_name(point)] = (recipe, reduce + [f"{k}={str(v).lower()}" for k, v in point.items()])
    starts = {"a": _point_name(start_point(recipe, reduce)), "b": _point_name(start_point(recipe, reduce + NAIVE))}
    if starts["a"] not in configs:  # e.g. the spleen recipe's gpu cache: not a grid point
        starts["a"] = "start (a) recipe"
        configs[starts["a"]] = (recipe, reduce)
    tuned = {}
    for name, extra in (("a", reduce), ("b", reduce + NAIVE)):
        t0 = time.monotonic()
        out = work / f"tuned-{label}-{name}.yaml"
        fv("tune", recipe, "--data", str(data), "--device", "cpu", "--budget", args.budget, "--out", str(out),
           "--json", str(out.with_suffix(".json")), "--fresh", "--force", "--keep", *KEEP,
           *sets(extra + COMMON), env={**os.environ, "FASTVISION_CACHE": str(work / "tune-cache")}, log=log)
        result = json.loads(out.with_suffix(".json").read_text())
        tuned[name] = {"seconds": time.monotonic() - t0, "chosen": result["chosen"], "verdict": result["verdict"],
                       "trials": len(result["trials"]), "untried": result["untried"], "speedup": result["speedup"]}
        configs[f"tuned ({name})"] = (str(out), [])
        print(f"{label} tune ({name}): {tuned[name]}", flush=True)
    walls = interleave(label, configs, args.rounds, data, epochs, work, log)
    med = {k: statistics.median(v) for k, v in walls.items()}
    grid_best = min((k for k in med if k.startswith("grid ")), key=med.get)
    speed = lambda a, b: med[b] / med[a]  # noqa: E731  (same items: throughput ratio = inverse wall ratio)
    return {"recipe": label, "reductions": reduce, "epochs": epochs, "synth": [kind, *synth_opts],
            "tuned": tuned, "starts": starts, "grid_best": grid_best, "wall_s": walls, "median_wall_s": med,
            "tuned_a_vs_start_a": speed("tuned (a)", starts["a"]),
            "tuned_b_vs_start_b": speed("tuned (b)", starts["b"]),
            "tuned_a_vs_grid_best": speed("tuned (a)", grid_best),
            "tuned_b_vs_grid_best": speed("tuned (b)", grid_best)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default="120s")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES)[:4], choices=list(RECIPES))
    p.add_argument("--out", type=Path, default=Path("/tmp/h27-tune/bench"))
    p.add_argument("--confirm", type=int, metavar="ROUNDS",
                   help="re-time the starts, tuned recipes and grid best of --out/results.json in ROUNDS rounds")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "commands.log"
    if args.confirm:
        return confirm(args, log)
    results = []
    for label in args.recipes:
        try:
            results.append(one_recipe(label, args, args.out, log))
        except RuntimeError as e:
            results.append({"recipe": label, "error": str(e)})
            print(f"{label}: {e}", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    report(results)


def report(results: list[dict]) -> None:
    print("| recipe | tuned (a) / start (a) | tuned (b) / start (b) | tuned (a) / grid best | tuned (b) / grid best "
          "| chosen (a) | chosen (b) | grid best |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['recipe']} | error: {r['error'][:80]} |")
            continue
        print(f"| {r['recipe']} | {r['tuned_a_vs_start_a']:.2f} | {r['tuned_b_vs_start_b']:.2f} | "
              f"{r['tuned_a_vs_grid_best']:.2f} | {r['tuned_b_vs_grid_best']:.2f} | {r['tuned']['a']['chosen']} | "
              f"{r['tuned']['b']['chosen']} | {r['grid_best']} |")
    print("\nmedian fit wall seconds per configuration:")
    for r in results:
        if "error" not in r:
            print(r["recipe"], json.dumps({k: round(v, 1) for k, v in r["median_wall_s"].items()}))


if __name__ == "__main__":
    main()
