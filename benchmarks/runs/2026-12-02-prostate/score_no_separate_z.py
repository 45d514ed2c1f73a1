# --score with the separate-z rule of the export switched off (every axis linear): what the rule is worth on this set
import runpy, sys
import fastvision.data.nnunet_resampling as nr
calls, orig = [], nr.coarse_axis
def coarse_axis(spacing, target):
    a = orig(spacing, target)
    if sys._getframe(1).f_code.co_name == "_nnunet_resize_back":
        calls.append(a)
        return None
    return a
nr.coarse_axis = coarse_axis
sys.argv = ["nnunet_parity.py", *sys.argv[1:]]
try:
    runpy.run_path("benchmarks/nnunet_parity.py", run_name="__main__")
finally:
    print("export calls, coarse axis the rule names:", calls)
