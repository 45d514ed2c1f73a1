"""Iterations to each paired nnU-Net round's last Dice - 0.02 and the mean curve, per screened setting.

    python3 ana.py heads he
"""
import json
import os
import statistics as st
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
R = os.path.join(HERE, "..", "2026-12-02-ct-resample", "ct")
nn = {r: json.load(open(f"{R}/nnunet-spleen-r{r}.json"))["curve"] for r in range(12)}


def curve(n, s):
    try:
        d = json.load(open(f"{HERE}/{n}-s{s}.json"))["spleen"]
    except FileNotFoundError:
        return None
    k = [k for k in d if k.startswith("fastvision")][0]
    return d[k]["curve"]


for n in sys.argv[1:]:
    hits, dices, t = [], [], []
    for s in range(12):
        c = curve(n, s)
        if c is None:
            continue
        target = nn[s][-1]["dice"] - 0.02
        h = next((p for p in c if p["dice"] >= target), None)
        hits.append(h["iterations"] if h else 999)
        t.append(h["train_s"] if h else 999)
        dices.append([round(p["dice"], 3) for p in c])
    print(n, len(hits), "iters to D-0.02:", hits, "median", st.median(hits), f"time median {st.median(t):.1f}")
    print("  " + "".join(f" it {8 * (j + 1)} mean {st.mean(d[j] for d in dices):.3f}" for j in range(8)))
