"""NaN and Inf in input files (a float TIFF, a NIfTI volume): found as each file is decoded.

``data.args.nonfinite`` of the readers that can yield floats (microscopy, decathlon, brats):
``error`` (the default, as nnU-Net's dataset integrity check) stops with one line naming the file,
exit 2; ``zero`` reads those values as 0 with one warning per file, in the words of
:mod:`fastvision.data.formats.anomalies`. The check runs where the file is decoded (the dataset
item, or the cache fill that stores it), so it costs one pass over an array already in memory per
read and nothing per training step. ``fastvision data inspect`` lists such files up front.
A leaf module (no format imports), so :mod:`fastvision.data.preprocess3d` can use it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastvision.errors import ConfigError, DataError

log = logging.getLogger(__name__)
NONFINITE = ("error", "zero")
# The row of ``fastvision data inspect`` listing such files.
NONFINITE_FILES = "files with NaN/Inf values (nonfinite=zero reads them as 0)"


def count_nonfinite(arr: np.ndarray) -> int:
    """How many NaN / +-Inf values ``arr`` holds (0 for integer arrays, which cannot hold them).

    One vectorised pass without a temporary in the common case: a sum in the array's own dtype
    is finite only when no value is NaN or Inf; a non-finite sum (one is, or the sum overflowed)
    pays for the elementwise count, which decides. (A float64 accumulator would be 40x slower on
    float32 data: a conversion per element.)
    """
    if arr.dtype.kind not in "fc" or arr.size == 0:
        return 0
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum only means: count them
        total = np.sum(arr)
    if np.isfinite(total):
        return 0
    return int(arr.size - np.count_nonzero(np.isfinite(arr)))


def zero_nonfinite(arr: np.ndarray) -> np.ndarray:
    """``arr`` with NaN / +-Inf set to 0 (``data.args.nonfinite: zero``); integer arrays as they are."""
    if arr.dtype.kind not in "fc":
        return arr
    return np.where(np.isfinite(arr), arr, np.zeros((), arr.dtype))


class NonFinite:
    """The ``data.args.nonfinite`` policy of one dataset, applied to each file as it is decoded.

    ``error`` (the default, as nnU-Net's integrity check): a file holding NaN or Inf stops the run
    with one line naming it (exit 2). ``zero``: those values are read as 0, with one warning per
    file (per process) naming it and the count. The check runs where the file is decoded (the item
    or the cache fill), once per read, never per step.
    """

    def __init__(self, policy: str = "error"):
        if policy not in NONFINITE:
            raise ConfigError(f"data.args.nonfinite must be one of {', '.join(NONFINITE)}, got {policy!r}")
        self.policy = policy
        self._warned: set[str] = set()  # files already named in a warning (one warning per file)

    def __call__(self, arr: np.ndarray, path: str | Path) -> np.ndarray:
        """``arr`` (decoded from ``path``) as is, or with NaN / Inf set to 0 under ``zero``."""
        bad = count_nonfinite(arr)
        if not bad:
            return arr
        if self.policy == "error":
            raise DataError(f"{path}: {bad} NaN/Inf value(s) (data.args.nonfinite=error; fix the file, or train "
                            "with --set data.args.nonfinite=zero to read them as 0: predict and evaluate follow the "
                            "run's setting)")
        if str(path) not in self._warned:
            self._warned.add(str(path))
            log.warning("%s: %d NaN/Inf value(s) read as 0 (data.args.nonfinite=zero)", path, bad)
        return zero_nonfinite(arr)


def nifti_nonfinite(files: Sequence[Path], root: Path) -> list[str]:
    """``["imagesTr/x.nii.gz (12)", ...]``: the float-stored files among ``files`` holding NaN / Inf
    (each read in full; an integer-stored file cannot hold them, so only its header is read)."""
    import nibabel as nib

    out = []
    for f in files:
        try:
            img = nib.load(str(f))
            n = count_nonfinite(np.asarray(img.dataobj)) if img.get_data_dtype().kind in "fc" else 0
        except Exception:  # noqa: BLE001  (a truncated or damaged file: the unreadable check names it)
            continue
        if n:
            out.append(f"{Path(f).relative_to(root) if Path(f).is_relative_to(root) else f} ({n})")
    return out
