import json, glob, sys, statistics as st
names = sys.argv[1:]
import os
HERE = os.path.dirname(os.path.abspath(__file__))
R = os.path.join(HERE, "..", "2026-12-02-ct-resample", "ct")
nn = {r: json.load(open(f"{R}/nnunet-spleen-r{r}.json"))["curve"] for r in range(12)}
def curve(n, s):
    try: d = json.load(open(f"{HERE}/{n}-s{s}.json"))["spleen"]
    except FileNotFoundError: return None
    k = [k for k in d if k.startswith("fastvision")][0]; return d[k]["curve"]
for n in names:
    hits, dices, its8, t = [], [], [], []
    for s in range(12):
        c = curve(n, s)
        if c is None: continue
        D = nn[s][-1]["dice"] - 0.02
        h = next((p for p in c if p["dice"] >= D), None)
        hits.append(h["iterations"] if h else 999); t.append(h["train_s"] if h else 999)
        dices.append([round(p["dice"], 3) for p in c])
    print(n, len(hits), "iters to D-0.02:", hits, "median", st.median(hits), "time median %.1f" % st.median(t))
    for j in range(8):
        v = [d[j] for d in dices]; print("   it %d mean %.3f" % (8 * (j + 1), st.mean(v)), end="")
    print()
