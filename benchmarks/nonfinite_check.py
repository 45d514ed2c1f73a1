"""What the NaN / Inf check of input files costs beside decoding the file it checks.

Writes a float32 NIfTI volume (``--shape``, gzip, standard-normal values) and a float32 TIFF
(``--image``), then times in alternating rounds the decode the readers do (nibabel into float32;
tifffile) alone and followed by ``data.nonfinite.count_nonfinite`` on the decoded array (a sum in
the array's dtype; the elementwise count only runs when the sum is not finite, so a clean file pays
the sum alone). Timed as totals, since the first pass over freshly decoded memory pays its page
faults whichever pass it is. Prints medians and their ratio.

    OMP_NUM_THREADS=1 python benchmarks/nonfinite_check.py [--rounds 5] [--shape 512 512 100] [--image 2048]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastvision.data.nonfinite import count_nonfinite  # noqa: E402


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    import nibabel as nib
    import tifffile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", type=int, nargs=3, default=[512, 512, 100])
    ap.add_argument("--image", type=int, default=2048, help="TIFF side (float32, one channel)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        vol, tif = Path(tmp) / "v.nii.gz", Path(tmp) / "i.tif"
        nib.save(nib.Nifti1Image(rng.standard_normal(args.shape).astype(np.float32), np.eye(4)), str(vol))
        tifffile.imwrite(tif, rng.standard_normal((args.image, args.image)).astype(np.float32))
        readers = {"nifti": lambda: np.asarray(nib.load(str(vol)).dataobj, dtype=np.float32),
                   "tiff": lambda: tifffile.imread(tif)}
        times = {k: {"decode": [], "decode+check": []} for k in readers}
        for r in range(args.rounds):  # alternate which goes first; each read is a fresh decode
            for name, read in readers.items():
                for way in ("decode", "decode+check") if r % 2 == 0 else ("decode+check", "decode"):
                    fn = read if way == "decode" else (lambda read=read: count_nonfinite(read()))
                    times[name][way].append(_timed(fn)[1])
    out = {name: {"decode_s": statistics.median(t["decode"]),
                  "decode_and_check_s": statistics.median(t["decode+check"]),
                  "ratio": statistics.median(t["decode+check"]) / statistics.median(t["decode"])}
           for name, t in times.items()}
    print(json.dumps({"shape": args.shape, "image": args.image, "rounds": args.rounds, **out}, indent=2))


if __name__ == "__main__":
    main()
