"""What ``fastvision tune`` writes: the trial table (printed and JSON), ``tuned.yaml`` that
``extends:`` the recipe, and a bar chart of items/s per trial beside it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fastvision import config
from fastvision.utils.files import atomic_text, save_figure


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def rows(result: dict[str, Any]) -> list[list[str]]:
    """The table's body: the start (the profiler's baseline), then one row per trial."""
    b = result["baseline"]
    out = [["start", "-", f"{b['items_per_s']:.1f}", "1.00", f"{b['p90_ms']:.1f}", _fmt(b.get("peak_mib"), ".0f"),
            f"{100 * b['data_share']:.0f}%", f"{result['verdict']}"]]
    final = [result["final"]] if result.get("final") else []
    for i, t in enumerate(result["trials"] + final, 1):
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}±{t['spread']:.2f}"
        also = "".join(f" (+ {k}={v})" for k, v in (t.get("implies") or {}).items())
        name = "final: tuned vs start" if t["key"] == "final" else f"{i}. {t['key']}={t['value']}{also}"
        out.append([name, t["kind"], _fmt(t["items_per_s"], ".1f"), ratio,
                    _fmt(t["p90_ms"], ".1f"), _fmt(t["peak_mib"], ".0f"),
                    "-" if t["data_share"] is None else f"{100 * t['data_share']:.0f}%", t["reason"]])
    return out


HEADER = ["trial (setting)", "kind", "items/s", "x incumbent", "p90 step ms", "peak MiB", "data wait", "result"]


def table(result: dict[str, Any]):
    """A rich Table of :func:`rows` with the summary as its caption."""
    from rich.table import Table

    t = Table(title=f"fastvision tune {result['recipe']} on {result['hardware']['where']}")
    for i, h in enumerate(HEADER):
        t.add_column(h, justify="right" if 2 <= i <= 6 else "left", overflow="fold")
    for r in rows(result):
        t.add_row(*r)
    t.caption = "\n".join(summary_lines(result))
    return t


def speedup_line(result: dict[str, Any]) -> str:
    """What the final check measured, or that none ran (no switch was kept: nothing to check)."""
    final = result.get("final")
    if not final:
        return "speed-up over the start: x1.00 (no switch kept, so no final trial ran)"
    if final.get("kept"):
        return f"measured speed-up over the start: x{result['speedup']:.2f} (final trial, interleaved rounds)"
    got = "-" if final.get("ratio") is None else f"x{final['ratio']:.2f}"
    return f"final trial: the tuned setting measured {got} the start ({final['reason']}), so the start stays"


def summary_lines(result: dict[str, Any]) -> list[str]:
    final = result.get("final")
    start = ("the start (the kept switches together did not beat it)" if final and not final.get("kept")
             else "the start (nothing beat it)")
    lines = [f"chosen: {_setting(result['chosen']) or start}", speedup_line(result)]
    if result["untried"]:
        lines.append(f"not tried (budget {result['budget_s']:.0f} s spent): {', '.join(result['untried'])}")
    if result.get("lr_line"):
        lines.append(result["lr_line"])
    return lines


def _setting(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def tuned_yaml(result: dict[str, Any]) -> str:
    """``extends:`` the recipe, then the user's ``--set`` values, then the chosen switches on top."""
    body = {}
    for text in result["sets"]:
        body = config.merge(body, config.parse_override(text))
    for key, value in result["chosen"].items():
        body = config.merge(body, config.nested(key, value))
    head = [f"# fastvision tune {result['recipe']} on {result['hardware']['where']} ({result['date']})",
            f"# start {result['baseline']['items_per_s']:.1f} items/s; "
            + (f"measured x{result['speedup']:.2f} with: {_setting(result['chosen'])}" if result["chosen"]
               else "nothing changed (no switch beat the start)")]
    if result.get("lr_line"):
        head.append(f"# {result['lr_line']}")
    head.append("# run: fastvision train THIS.yaml --data DIR")
    return "\n".join(head) + "\n" + yaml.safe_dump({"extends": result["extends"], **body}, sort_keys=False)


def chart(result: dict[str, Any], path: Path) -> Any:
    """Bar chart: items/s of the start and of every trial (kept green, dropped grey, errors red)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names, values, colours, labels = ["start"], [result["baseline"]["items_per_s"]], ["#4c72b0"], [""]
    for i, t in enumerate(result["trials"] + ([result["final"]] if result.get("final") else []), 1):
        names.append("final" if t["key"] == "final" else f"{i}. {t['key'].split('.')[-1]}={t['value']}")
        values.append(t["items_per_s"] or 0.0)
        labels.append("" if t["ratio"] is None else f"x{t['ratio']:.2f}")
        colours.append("#55a868" if t["kept"] else "#c44e52" if t["reason"].startswith("error") else "#999999")
    fig = Figure(figsize=(max(5.0, 0.7 * len(names) + 2), 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars = ax.bar(range(len(names)), values, color=colours)
    ax.bar_label(bars, labels, fontsize=7)  # the round ratio against the incumbent of the moment
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("items/s (median of rounds)")
    # two lines: on one, a 5-inch chart of few trials cut the legend off at the right edge
    ax.set_title(f"tune {result['recipe']}\ngreen kept, grey not faster / parity, red error", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    return fig


def write_all(result: dict[str, Any], out: Path, json_path: Path | None) -> list[Path]:
    """tuned.yaml, the PNG beside it and the JSON (when asked), each written atomically."""
    atomic_text(out, tuned_yaml(result))
    png = out.with_suffix(".png")
    chart(result, png)
    written = [out, png]
    if json_path is not None:
        atomic_text(json_path, json.dumps(result, indent=2, default=str))
        written.append(json_path)
    return written
