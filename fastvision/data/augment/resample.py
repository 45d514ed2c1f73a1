"""The affine's resampling as one fused CPU kernel: ``torch.compile`` of a plain trilinear (image) and
nearest (class-index label) sampler, written as gathers so inductor emits a single loop over the output.

``F.grid_sample`` in 3-D runs a scalar per-voxel loop on the CPU (about 27 ns a voxel on one core), and
the label needs a second call on a float copy; the fused kernel computes each output voxel's source
position once and reads the 8 image neighbours and the nearest label voxel from it: about 2x cheaper
per firing sample (benchmarks/aug_vs_nnunet.py). Same sampling as
``grid_sample(align_corners=False, padding_mode="zeros")``: bilinear to 1e-5 (rounding of the source
coordinates), nearest the same voxel except where a coordinate lies within float rounding of a half.

Opt-in (``data.augment.affine.compiled: true``): the first call per shape compiles (about 20 s on two
cores; inductor caches the code on disk for later runs). Where compiling fails the op falls back to
``grid_sample``, with one warning.
"""
from __future__ import annotations

import logging
import threading

import torch
from torch import Tensor

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_COMPILED: dict[str, object] = {}


def _base(n: int, device: torch.device) -> Tensor:
    """Normalised centres of ``n`` voxels (align_corners=False): (2 i + 1) / n - 1."""
    return (torch.arange(n, device=device, dtype=torch.float32) * 2 + 1) / n - 1


def sample(image: Tensor, label: Tensor | None, lin: Tensor) -> tuple[Tensor, Tensor | None]:
    """Resample (N, C, D, H, W) ``image`` (trilinear) and (N, D, H, W) index ``label`` (nearest) at
    ``lin @ (x, y, z)``, ``lin`` (N, 3, 3) acting on normalised (x, y, z) = (W, H, D) coordinates, zeros
    (label 0) outside: ``grid_sample`` of ``affine_grid([lin | 0])``."""
    n, c, d, h, w = image.shape
    x = _base(w, image.device).reshape(1, 1, 1, w)
    y = _base(h, image.device).reshape(1, 1, h, 1)
    z = _base(d, image.device).reshape(1, d, 1, 1)
    m = lin.float().reshape(n, 3, 3, 1, 1, 1)
    # source position in voxels, per axis (grid_sample's unnormalisation: ((g + 1) size - 1) / 2)
    ix = ((m[:, 0, 0] * x + m[:, 0, 1] * y + m[:, 0, 2] * z + 1) * w - 1) / 2
    iy = ((m[:, 1, 0] * x + m[:, 1, 1] * y + m[:, 1, 2] * z + 1) * h - 1) / 2
    iz = ((m[:, 2, 0] * x + m[:, 2, 1] * y + m[:, 2, 2] * z + 1) * d - 1) / 2
    flat = image.reshape(n, c, d * h * w)
    x0, y0, z0 = ix.floor(), iy.floor(), iz.floor()
    fx, fy, fz = ix - x0, iy - y0, iz - z0
    out = torch.zeros_like(image)
    for dz in (0, 1):
        zz, wz = z0 + dz, (fz if dz else 1 - fz)
        for dy in (0, 1):
            yy, wy = y0 + dy, (fy if dy else 1 - fy)
            for dx in (0, 1):
                xx, wx = x0 + dx, (fx if dx else 1 - fx)
                out = out + _read(flat, xx, yy, zz, (d, h, w)) * (wx * wy * wz).unsqueeze(1)
    if label is None:
        return out, None
    lab = _read(label.reshape(n, 1, d * h * w), ix.round(), iy.round(), iz.round(), (d, h, w))
    return out, lab.reshape(label.shape).to(label.dtype)


def _read(flat: Tensor, xx: Tensor, yy: Tensor, zz: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """``flat`` (N, C, D*H*W) at integer-valued float voxel positions (N, D, H, W), 0 outside."""
    d, h, w = shape
    inside = (xx >= 0) & (xx <= w - 1) & (yy >= 0) & (yy <= h - 1) & (zz >= 0) & (zz <= d - 1)
    idx = (zz.clamp(0, d - 1) * h + yy.clamp(0, h - 1)) * w + xx.clamp(0, w - 1)
    n, c = flat.shape[:2]
    v = torch.gather(flat, 2, idx.long().reshape(n, 1, -1).expand(n, c, -1)).reshape(n, c, *xx.shape[1:])
    return v * inside.unsqueeze(1).to(v.dtype)


def compiled_sample():
    """``torch.compile(sample)`` made once per process (None where compiling is not possible)."""
    with _LOCK:
        if "fn" not in _COMPILED:
            try:
                _COMPILED["fn"] = torch.compile(sample, dynamic=False)
            except Exception as e:  # noqa: BLE001 (no compiler back-end: any error means fall back)
                log.warning("data.augment.affine.compiled: torch.compile unavailable (%s); using grid_sample", e)
                _COMPILED["fn"] = None
        return _COMPILED["fn"]


def run_compiled(image: Tensor, label: Tensor | None, lin: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """The compiled kernel's result, or None (fall back) where it cannot run: not 3-D, a label that is
    not a class-index tensor, or a compile error (warned once; every later call falls back)."""
    fn = compiled_sample()
    if fn is None or image.dim() != 5 or (label is not None and (label.dim() != 4 or label.dtype.is_floating_point)):
        return None
    try:
        if image.shape[1] == 1:
            return fn(image, label, lin)
        # one channel at a time: the kernel gathers one channel per index (several expand the gather 5x slower)
        outs = [fn(image[:, c:c + 1].contiguous(), label if c == 0 else None, lin) for c in range(image.shape[1])]
        return torch.cat([o for o, _ in outs], 1), outs[0][1]
    except Exception as e:  # noqa: BLE001 (inductor needs a C++ compiler at run time: fall back on any failure)
        with _LOCK:
            if _COMPILED.get("fn") is not None:
                log.warning("data.augment.affine.compiled: compiling failed (%s); using grid_sample", e)
            _COMPILED["fn"] = None
        return None
