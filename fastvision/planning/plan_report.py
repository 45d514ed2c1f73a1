"""What ``fastvision plan`` shows: the plan (:func:`fastvision.planning.plan.make_plan`'s dict) as
an aligned text table with the switches below it, and the PNG of time to train and cost against
GPU count (with ``--epochs-from``, the time to the target: the median seed and the seeds' band)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _range(pair, scale=1.0, spec="{:.3g}") -> str:
    lo, hi = spec.format(pair[0] * scale), spec.format(pair[1] * scale)
    return lo if lo == hi else f"{lo}-{hi}"


def _money(pair) -> str:
    """A cost range: whole units from 100 on, else three significant digits (a small run is not "0")."""
    return _range(pair, 1, "{:,.0f}" if pair[0] >= 100 else "{:.3g}")


def _duration(pair) -> str:
    unit, scale = ("h", 1 / 3600) if pair[1] >= 3600 else ("min", 1 / 60) if pair[1] >= 60 else ("s", 1)
    return _range(pair, scale) + " " + unit


def text_report(plan: dict[str, Any]) -> str:
    """The plan as an aligned text table, the switches below it."""
    e = plan["estimate"]
    p = e["memory_parts_gib"]
    fit = "fits" if e["fits"] else "DOES NOT FIT"
    where = f"{plan['link']} nodes" if plan.get("hardware") else f"{plan['link']} between nodes"
    lines = [f"plan: {plan['recipe']} on {plan['gpus']} x {plan['gpu']} ({plan['gpu_memory_gib']:.0f} GiB), "
             f"{plan['gpus_per_node']} per node, {where}", ""]
    rows = [("per-GPU batch", f"{e['batch']} ({e['precision']}{', compile' if e['compile'] else ''}"
                              f"{', channels_last' if plan['channels_last'] else ''})"),
            ("memory at that batch", f"{e['memory_gib']:.2f} GiB ({fit}); at the peak: params "
                                     f"{p['parameters']:.2f}, grads {p['gradients']:.2f}, optimizer "
                                     f"{p['optimizer_state']:.2f}, inputs {p['inputs']:.2f}, activations "
                                     f"{p['activations']:.2f}, workspace {p['workspace']:.2f}"),
            ("largest batch that fits", str(e["largest_batch"])),
            ("FLOPs per step", f"{e['flops_per_step'] / 1e12:.3g} TFLOP ({e['flops_per_step'] / e['batch'] / 1e9:,.1f} "
                               f"GFLOP per item)"),
            ("step time", f"{_range(e['step_s'], 1e3)} ms (achieved {_range(plan['achieved'], 100, '{:.0f}')} % of "
                          f"peak, {plan['achieved_source']}; + {plan['fixed_ms']:.2f} ms per step fixed, "
                          f"{plan['fixed_source']})"),
            ("items/s per GPU", _range([e["batch"] / e["step_s"][1], e["batch"] / e["step_s"][0]], 1, "{:.0f}")),
            (f"scaling efficiency at {plan['gpus']}", _range(sorted(e["efficiency"]), 100, "{:.0f}") + " %")]
    rows += _scale_rows(plan)
    if "epoch_s" in e:
        rows += [("dataset", f"{plan['dataset_items']:,} items ({plan['dataset_source']})"),
                 ("epoch time", _duration(e["epoch_s"])),
                 (f"time to train {plan['epochs']} epochs", _duration(e["train_s"])),
                 ("GPU-hours", _range(e["gpu_hours"], 1, "{:.3g}"))]
        if "cost" in e:
            rows.append(("cost", _money(e["cost"]) + f" at {plan['price_per_gpu_hour']:g} per GPU-hour"))
    rows += _forecast_rows(plan)
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    if plan.get("switches"):
        lines += ["", "switches that change the answer most:"]
        for s in plan["switches"]:
            when = f"time {s['change']:+.0%}" if "train_s" in s else f"step {s['change']:+.0%}"
            flags = " ".join(f"--set {o}" for o in s["set"])
            lines.append(f"  {s['switch']:<28} memory {s['memory_gib']:.2f} GiB ({s['memory_change']:+.0%}), "
                         f"largest batch {s['largest_batch']}, {when}  [{flags}]")
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def _forecast_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The time-to-target forecast: median, olympic mean and the seeds' range, each a low-high range."""
    f = plan.get("forecast")
    if not f:
        return []
    ep = ", ".join(f"{k:g}" for k in f["epochs"])
    t, h = f["train_s"], f["gpu_hours"]
    rows = [(f"time to {f['target']} (forecast)",
             f"median {_duration(t['median'])}, olympic mean {_duration(t['olympic_mean'])}; fastest to slowest "
             f"seed {_duration(t['range'])} ({f['reached']} of {f['seeds']} seeds reached it, epochs {ep})"),
            ("GPU-hours to the target", f"median {_range(h['median'], 1, '{:.3g}')}, seeds "
                                         f"{_range(h['range'], 1, '{:.3g}')}")]
    if "cost" in f:
        rows.append(("cost to the target", f"median {_money(f['cost']['median'])}, seeds {_money(f['cost']['range'])}"))
    return rows


def _scale_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The at-scale answer: step, throughput per GPU and in total, binding limit, input path, largest N."""
    sc = plan["estimate"]["scale"]
    n = plan["gpus"]
    rows = [(f"step at {n} GPUs", _range(sorted(s["step_s"] for s in sc), 1e3) + " ms"),
            ("items/s per GPU at scale", _range(sorted(s["items_per_s_gpu"] for s in sc), 1, "{:,.0f}")),
            (f"items/s on {n} GPUs", _range(sorted(s["items_per_s"] for s in sc), 1, "{:,.0f}")),
            ("binding limit", " / ".join(dict.fromkeys(s["limit"] for s in sc)))]
    need = [s["cores_per_gpu"] for s in sc if s["cores_per_gpu"] is not None]
    have = sc[0]["cores_available_per_gpu"]
    where = f"{have:.1f} per GPU on the node ({plan['host_source']})" if have else plan["host_source"]
    rows.append(("host cores per GPU to feed it", f"{_range(sorted(need), 1, '{:.1f}')} at "
                 f"{plan['input_rate_per_core']:.0f} items/s per core ({plan['input_source']}); {where}")
                if need else ("input path", plan["input_source"]))
    if plan.get("largest_gpus"):
        rows.append((f"largest N at >= {plan['min_efficiency']:.0%} efficiency",
                     _range(sorted(plan["largest_gpus"]), 1, "{:,}")))
    return rows


def plot(plan: dict[str, Any], path: Path) -> Path:
    """Time to train (left axis) and cost (right axis) against GPU count."""
    from fastvision.scaling.report import _pyplot
    from fastvision.scaling.report import save as _save

    plt = _pyplot()
    curve = [r for r in plan["curve"] if "train_h" in r]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    if curve:
        x = [r["gpus"] for r in curve]
        ax.plot(x, [r["train_h"] for r in curve], "o-", color="C0", label=f"time to train {plan['epochs']} epochs")
        if "target_h" in curve[0]:  # the forecast: the seeds' median epochs, the band from fastest to slowest
            target = plan["forecast"]["target"]
            batch = plan["forecast"].get("global_batch")
            at = f"; epochs as at global batch {batch}" if batch else ""
            ax.plot(x, [r["target_h"][1] for r in curve], "^-", color="C2", label=f"time to {target} (median seed{at})")
            ax.fill_between(x, [r["target_h"][0] for r in curve], [r["target_h"][2] for r in curve], color="C2",
                            alpha=0.2, label="fastest to slowest seed")
            ax.legend(loc="upper right", fontsize=7)
        ax.set_ylabel("time to train (h)", color="C0")
        if "cost" in curve[0]:
            ax2 = ax.twinx()
            ax2.plot(x, [r["cost"] for r in curve], "s--", color="C1", label="cost")
            ax2.set_ylabel("cost", color="C1")
        ax.axvline(plan["gpus"], color="k", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log")
    ax.set(xlabel="GPUs", title=f"{plan['recipe']} on {plan['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def check_outputs(json_path: Path | None, png: Path | None, force: bool) -> None:
    """``--json`` and ``--png`` before the trace: not over an existing file without ``force``, not a folder,
    not one file for both (the PNG replaced the JSON), and a PNG name matplotlib writes (a traceback after
    the whole plan, before).

    Raises:
        DataError: naming the option.
    """
    from fastvision.api import refuse_overwrite
    from fastvision.errors import DataError
    from fastvision.utils.files import check_figure_name

    for path, flag in ((json_path, "--json"), (png, "--png")):
        if path:
            refuse_overwrite(path, force, flag, file=True)
    if json_path and png and Path(json_path).resolve() == Path(png).resolve():
        raise DataError(f"--json {json_path} / --png {png}: one file for both; give each its own name")
    if png:
        check_figure_name(png, "--png")
