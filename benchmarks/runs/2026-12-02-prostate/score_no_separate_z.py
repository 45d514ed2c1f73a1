"""``nnunet_parity.py --score`` with the export's separate-z rule switched off (every axis linear): what the rule is
worth on this set. Same arguments as nnunet_parity.py; prints the coarse axis the rule named in each export call."""
import runpy
import sys

import fastvision.data.nnunet_resampling as nr

calls, orig = [], nr.coarse_axis


def coarse_axis(spacing, target):
    a = orig(spacing, target)
    if sys._getframe(1).f_code.co_name == "_nnunet_resize_back":  # the export only; preprocessing keeps the rule
        calls.append(a)
        return None
    return a


nr.coarse_axis = coarse_axis
sys.argv = ["nnunet_parity.py", *sys.argv[1:]]
try:
    runpy.run_path("benchmarks/nnunet_parity.py", run_name="__main__")
finally:
    print("export calls, coarse axis the rule names:", calls)
