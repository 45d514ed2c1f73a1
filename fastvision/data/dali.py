"""NVIDIA DALI input pipeline for ImageFolder / ImageNet data (``data.args.backend: dali``).

Seed 004's pipeline: DALI's file reader shards the file list by rank, the decoder fuses the
random-resized crop (``decoders.image_random_crop``: libjpeg-turbo on the CPU, nvJPEG as "mixed"
on the GPU), then resize and flip; validation decodes and resamples the Pillow path's centre box
("shorter side to ``resize_size``, centre ``image_size``") to S x S in one resize.
Batches are ``{"image": uint8 (B, 3, S, S), "label": int64 (B,)}`` like the Pillow path's
collated items, so the classification task normalises them the same way. ``data.args.dali_device``
picks ``cpu`` (``device_id=None``: no GPU needed), ``gpu`` or ``auto`` (gpu when the run's device
is CUDA).

DALI is its own loader: the engine calls :meth:`DaliImageFolder.make_loader` (its seam for a
dataset that shards itself) instead of wrapping the dataset in a cache, sampler and loader, so
``data.cache`` must stay ``none``; ``dataset[i]`` is a one-line ConfigError saying so.

Determinism: each epoch the whole file list is permuted by a generator of ``(seed, epoch)`` (the
same on every rank), cut to a multiple of the world size, and read unshuffled; the reader's
``shard_id`` / ``num_shards`` split it into equal contiguous shards, disjoint and covering. The
crops and flips come from DALI's own generators, seeded from ``(seed, epoch, rank)``, and the
pipeline is rebuilt for every epoch, so an epoch's batches depend only on (seed, epoch, rank,
world size): the same seed gives the same run, and resuming at an epoch boundary replays it.
What differs from the Pillow path: the order and the draws are not the Pillow path's (DALI's
generators are not torch's), and a different world size gives different batches.

Validation shards are contiguous and unpadded (the reader's ``pad_last_batch`` off, the iterator's
last batch partial), so every image is evaluated exactly once across ranks.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fastvision.errors import ConfigError, DataError

DEVICES = ("cpu", "gpu", "auto")


def require_dali() -> Any:
    """The ``nvidia.dali`` module, or a one-line ConfigError saying how to install it."""
    try:
        import nvidia.dali as dali
        from nvidia.dali.plugin import pytorch as dali_torch  # noqa: F401
    except ImportError:
        raise ConfigError("data.args.backend=dali needs NVIDIA DALI: pip install -e \".[dali]\" (nvidia-dali-cuda130; "
                          "it runs on the CPU too), or use the default backend: pillow") from None
    return dali


def resolve_device(dali_device: str, device: torch.device) -> str:
    """``cpu`` or ``gpu`` for ``data.args.dali_device`` on a run whose device is ``device``."""
    if dali_device not in DEVICES:
        raise ConfigError(f"data.args.dali_device must be one of {', '.join(DEVICES)}, got {dali_device!r}")
    if dali_device == "auto":
        return "gpu" if device.type == "cuda" else "cpu"
    if dali_device == "gpu" and not torch.cuda.is_available():
        raise ConfigError("data.args.dali_device=gpu decodes with nvJPEG and needs a CUDA device; use cpu")
    return dali_device


def epoch_files(samples: list[tuple[str, int]], train: bool, seed: int, epoch: int,
                num_shards: int) -> list[tuple[str, int]]:
    """The list the reader gets: training, permuted by ``(seed, epoch)`` and cut to a multiple of
    ``num_shards`` (equal shards, so every rank takes the same number of steps); validation as is."""
    if not train:
        return list(samples)
    order = np.random.default_rng([seed, epoch]).permutation(len(samples))
    keep = len(samples) // num_shards * num_shards
    return [samples[i] for i in order[:keep]]


def shard_bounds(n: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """``[start, end)`` of the reader's shard ``shard_id`` of ``n`` samples (DALI's split)."""
    return n * shard_id // num_shards, n * (shard_id + 1) // num_shards


def pipeline_seed(seed: int, epoch: int, rank: int) -> int:
    """DALI's pipeline seed for one rank's epoch (a 31-bit integer of ``(seed, epoch, rank)``)."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0] & 0x7FFFFFFF)


class DaliImageFolder:
    """A list of ``(path, label)`` samples that builds its own DALI loader.

    Args:
        samples: ``(path, class index)`` pairs (the Pillow path's list, checked the same way).
        train: random-resized crop + flip; else resize the shorter side + centre crop.
        image_size: output side S.
        resize_size: evaluation shorter side before the centre crop.
        scale, ratio: random-resized-crop area fraction and aspect (w/h) ranges.
        hflip: horizontal flip probability (training).
        dali_device: ``cpu``, ``gpu`` or ``auto``.
        threads: DALI CPU threads per pipeline (None: the CPU count, at most 8).
        explain: ``explain(path, full)`` -> the Pillow path's DataError for ``path`` (its header
            only unless ``full``), or None when Pillow reads it: names a file DALI fails on.
    """

    def __init__(self, samples: list[tuple[str, int]], *, train: bool, image_size: int, resize_size: int,
                 scale: tuple[float, float], ratio: tuple[float, float], hflip: float,
                 dali_device: Literal["cpu", "gpu", "auto"] = "auto", threads: int | None = None,
                 explain: Callable[[str, bool], DataError | None] | None = None):
        require_dali()
        resolve_device(dali_device, torch.device("cpu"))  # the value is checked at build time
        self.samples, self.train = samples, train
        self.image_size, self.resize_size = image_size, resize_size
        self.scale, self.ratio, self.hflip = tuple(scale), tuple(ratio), hflip
        self.dali_device = dali_device
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.explain = explain

    def __len__(self) -> int:
        return len(self.samples)

    def report(self) -> str:
        """One line for logs and the data benchmark: what DALI runs."""
        what = "random-resized crop fused into decode, resize, flip" if self.train else "decode, centre-crop resize"
        return (f"DALI {self.dali_device} pipeline ({what}; {self.threads} threads): {len(self)} files, "
                "not cached")

    def __getitem__(self, i: int) -> dict:
        raise ConfigError("data.args.backend=dali: DALI's loader makes the batches, items are not read one by one; "
                          "set data.cache: none and data.augment: {} (or use backend: pillow)")

    def make_loader(self, *, batch_size: int, shard_id: int, num_shards: int, seed: int,
                    device: torch.device) -> DaliLoader:
        """This rank's loader (the engine's ``make_loader`` seam for a dataset that shards itself)."""
        return DaliLoader(self, batch_size, shard_id, num_shards, seed, resolve_device(self.dali_device, device),
                          device)


def _center_roi(shape, crop: int, resize: int):
    """Relative ``(roi_start, roi_end)`` ([y, x]) of "shorter side -> ``resize``, centre crop ``crop``"
    in an image of ``shape`` (H, W, C): the Pillow path's box (``imagefolder.center_box``), so the
    crop is resampled once from the decoded image, as Pillow does, and not from a rounded resize."""
    import nvidia.dali.math as dmath
    from nvidia.dali import fn

    h, w = shape[0], shape[1]
    side = crop * dmath.min(h, w) / resize  # the crop's side in original pixels
    rh, rw = dmath.min(side, h) / h, dmath.min(side, w) / w
    return fn.stack((1 - rh) / 2, (1 - rw) / 2), fn.stack((1 + rh) / 2, (1 + rw) / 2)


def _graph(data: DaliImageFolder, files: list[str], labels: list[int], shard_id: int, num_shards: int,
           dali_device: str):
    """The pipeline's outputs ``(images uint8 (3, S, S) per sample, labels)`` (call inside a pipeline)."""
    from nvidia.dali import fn, types

    jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=False, shard_id=shard_id,
                                   num_shards=num_shards, pad_last_batch=False, name="Reader")
    decoder = "mixed" if dali_device == "gpu" else "cpu"
    resize = dict(interp_type=types.INTERP_LINEAR, antialias=True)  # Pillow's BILINEAR (antialiased)
    s = data.image_size
    if data.train:
        images = fn.decoders.image_random_crop(jpegs, device=decoder, output_type=types.RGB,
                                               random_area=list(data.scale), random_aspect_ratio=list(data.ratio),
                                               num_attempts=10)
        images = fn.resize(images, resize_x=s, resize_y=s, **resize)
        mirror = fn.random.coin_flip(probability=data.hflip)
    else:
        images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
        start, end = _center_roi(fn.peek_image_shape(jpegs, dtype=types.FLOAT), s, data.resize_size)
        images = fn.resize(images, size=[s, s], roi_start=start, roi_end=end, roi_relative=True, **resize)
        mirror = 0
    images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=mirror)
    return images, (label.gpu() if dali_device == "gpu" else label)


class DaliLoader:
    """Iterates ``{"image": uint8 (B, 3, S, S), "label": int64 (B,)}`` batches of this rank's shard
    (on the GPU with ``dali_device`` gpu, else on the CPU); ``set_epoch`` before every epoch."""

    def __init__(self, data: DaliImageFolder, batch_size: int, shard_id: int, num_shards: int, seed: int,
                 dali_device: str, device: torch.device):
        self.data, self.batch_size, self.shard_id, self.num_shards = data, batch_size, shard_id, num_shards
        self.seed, self.dali_device, self.device, self.epoch, self.start_batch = seed, dali_device, device, 0, 0
        n = len(epoch_files(data.samples, data.train, seed, 0, num_shards))
        start, end = shard_bounds(n, shard_id, num_shards)
        self.shard_len = end - start
        if data.train and self.shard_len == 0:
            raise ConfigError(f"{len(data.samples)} training images cannot be sharded over {num_shards} ranks")
        # training drops a partial last batch (as the Pillow path does) unless the shard is smaller
        self.drop_last = data.train and self.shard_len >= batch_size
        full, rest = divmod(self.shard_len, batch_size)
        self.batches = full if self.drop_last else full + (rest > 0)

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """The next iteration reads epoch ``epoch``'s order and draws, from sample ``start_sample`` of
        the epoch, all shards together (a mid-epoch resume: DALI decodes the batches before it
        again, since its random crops are a stream per (seed, epoch, shard), and drops them)."""
        self.epoch, self.start_batch = epoch, start_sample // (self.batch_size * self.num_shards)

    def _pipeline(self, samples: list[tuple[str, int]]):
        from nvidia.dali import pipeline_def

        device_id = None
        if self.dali_device == "gpu":
            device_id = self.device.index if self.device.type == "cuda" and self.device.index is not None \
                else torch.cuda.current_device()

        @pipeline_def(batch_size=self.batch_size, num_threads=self.data.threads, device_id=device_id,
                      seed=pipeline_seed(self.seed, self.epoch, self.shard_id))
        def pipe():
            return _graph(self.data, [p for p, _ in samples], [int(y) for _, y in samples], self.shard_id,
                          self.num_shards, self.dali_device)

        return pipe()

    def __iter__(self):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        samples = epoch_files(self.data.samples, self.data.train, self.seed, self.epoch, self.num_shards)
        if self.batches == 0:
            return
        start, end = shard_bounds(len(samples), self.shard_id, self.num_shards)
        policy = LastBatchPolicy.DROP if self.drop_last else LastBatchPolicy.PARTIAL
        try:
            pipeline = self._pipeline(samples)
            pipeline.build()
            iterator = DALIGenericIterator([pipeline], ["image", "label"], reader_name="Reader",
                                           last_batch_policy=policy, last_batch_padded=False, auto_reset=False)
            for k, out in enumerate(iterator):
                if k == self.batches:
                    break
                if k < self.start_batch:
                    continue
                yield {"image": out[0]["image"], "label": out[0]["label"].view(-1).long()}
        except RuntimeError as e:  # DALI stops the pipeline at the first sample it cannot decode
            raise decode_error(e, samples[start:end], self.data) from None


def decode_error(err: Exception, shard: list[tuple[str, int]], data: DaliImageFolder) -> DataError:
    """The Pillow path's one-line error for the file DALI failed on.

    DALI names a file it fails to decode ("Failed to decode sample #k : PATH") but not one whose
    header it cannot parse; then this shard's headers are read as the Pillow path reads them, and
    the first unreadable file is named. ``data.explain(path, full)`` gives the Pillow path's error.
    """
    named = re.findall(r"Failed to decode sample #\d+ : (.+?)\s*$", str(err), flags=re.MULTILINE)
    if data.explain is not None:
        for path in named[:1] or [p for p, _ in shard]:
            found = data.explain(path, bool(named))
            if found is not None:
                return found
    detail = next((ln.strip() for ln in str(err).splitlines() if "failure" in ln or "Failed" in ln),
                  str(err).splitlines()[-1] if str(err) else type(err).__name__)
    where = named[0] if named else str(Path(shard[0][0]).parent.parent) if shard else "?"
    return DataError(f"{where}: DALI cannot decode an image ({detail})")
