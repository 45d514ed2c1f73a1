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

One pipeline per loader, built at its first epoch and reset for every later one: DALI reads
this rank's batches from :class:`_EpochSource`, an external source that hands it the encoded
files, the labels and, for training, each sample's crop window and flip. Each epoch the whole
file list is permuted by a generator of ``(seed, epoch)`` (the same on every rank), cut to a
multiple of the world size and split into equal contiguous shards, disjoint and covering. The
crop (:func:`~fastvision.data.transforms.random_resized_box`, the Pillow path's sampler; the size
from the JPEG header, parsed from the bytes already read) and the flip are drawn from a generator of
``(seed, epoch, sample index)``, so an epoch's batches depend only on (seed, epoch, rank, world
size): the same seed gives the same run, and a resume, at an epoch boundary or mid-epoch, starts
at its batch without decoding the ones before it. DALI decodes only the window
(``decoders.image_slice``). What differs from the Pillow path: the JPEG decoder and resampler,
and a different world size gives different batches.

Validation shards are contiguous and unpadded (the last batch partial), so every image is
evaluated exactly once across ranks.

Errors: a file DALI's decoder rejects is named with the Pillow path's one-line DataError; any
other failure (CUDA out of memory, an operator's own error) propagates with its own message.
Threads: ``data.args.dali_threads``, else the CPUs this process may run on
(``os.sched_getaffinity``: what SLURM or ``taskset`` grants), at most 8.
"""
from __future__ import annotations

import io
import re
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from fastvision.data.transforms import item_generator, random_resized_box
from fastvision.errors import ConfigError, DataError

DEVICES = ("cpu", "gpu", "auto")
# the detail of an error that is the machine's, not the file's (DALI's CUDA and host allocators)
_MEMORY = re.compile(r"out of memory|allocation failed|bad_alloc|cudaErrorMemoryAllocation", re.IGNORECASE)
# what DALI's decoders say about data they cannot decode
_UNDECODABLE = re.compile(r"codec|decod|marker|unsupported|corrupt|truncat|invalid (jpeg|image|data|file)",
                          re.IGNORECASE)


def default_threads() -> int:
    """DALI CPU threads: the CPUs this process may run on (SLURM's and taskset's affinity), at most 8."""
    from fastvision.utils.hostcpu import process_cores

    return max(1, min(8, len(process_cores())))


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


def epoch_order(n: int, train: bool, seed: int, epoch: int, num_shards: int) -> list[int]:
    """Sample indices of an epoch, all ranks together: training, permuted by ``(seed, epoch)`` and cut
    to a multiple of ``num_shards`` (equal shards, so every rank takes the same number of steps);
    validation in order."""
    if not train:
        return list(range(n))
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[: n // num_shards * num_shards].tolist()


def epoch_files(samples: list[tuple[str, int]], train: bool, seed: int, epoch: int,
                num_shards: int) -> list[tuple[str, int]]:
    """The samples of :func:`epoch_order`."""
    return [samples[i] for i in epoch_order(len(samples), train, seed, epoch, num_shards)]


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
        threads: DALI CPU threads per pipeline (None: :func:`default_threads`).
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
        self.threads = threads or default_threads()
        self.explain = explain

    def __len__(self) -> int:
        return len(self.samples)

    def report(self) -> str:
        """One line for logs and the data benchmark: what DALI runs."""
        what = "random-resized crop window decoded alone, resize, flip" if self.train else "decode, centre-crop resize"
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


class _EpochSource:
    """DALI's external source: this rank's batches of one epoch, from :meth:`start` to its end.

    Each call returns one batch: the files' encoded bytes (uint8), the labels (int64) and, for
    training, each sample's crop ``anchor`` ([x, y]) and ``shape`` ([w, h]) in pixels and its flip,
    drawn from a generator of ``(seed, epoch, sample index)``; StopIteration ends the epoch.
    ``pending`` holds the files of the batches handed to DALI and not yet returned by it: the
    ones a decoding error can come from.
    """

    def __init__(self, data: DaliImageFolder, batch_size: int, shard_id: int, num_shards: int, seed: int):
        self.data, self.batch_size, self.shard_id, self.num_shards, self.seed = \
            data, batch_size, shard_id, num_shards, seed
        self.epoch, self.indices, self.next, self.end = 0, [], 0, 0
        self.pending: deque[list[str]] = deque()

    def start(self, epoch: int, first: int, end: int) -> None:
        """Batches ``first`` .. ``end - 1`` of epoch ``epoch`` come next."""
        order = epoch_order(len(self.data.samples), self.data.train, self.seed, epoch, self.num_shards)
        lo, hi = shard_bounds(len(order), self.shard_id, self.num_shards)
        self.epoch, self.indices, self.next, self.end = epoch, order[lo:hi], first, end
        self.pending.clear()

    def stop(self) -> None:
        """No more batches this epoch (the loop left it early)."""
        self.end = self.next

    def __call__(self, info: Any = None) -> tuple[list[np.ndarray], ...]:
        if self.next >= self.end:
            raise StopIteration
        b = self.batch_size
        chosen = self.indices[self.next * b:(self.next + 1) * b]
        self.next += 1
        files = [self.data.samples[i][0] for i in chosen]
        self.pending.append(files)
        encoded = [_read(f) for f in files]
        labels = [np.array(self.data.samples[i][1], dtype=np.int64) for i in chosen]
        if not self.data.train:
            return encoded, labels
        draws = [self._window(e, f, i) for e, f, i in zip(encoded, files, chosen, strict=True)]
        return encoded, labels, *(list(x) for x in zip(*draws, strict=True))

    def _window(self, encoded: np.ndarray, path: str, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(anchor [x, y], shape [w, h], flip)`` of one training sample (the Pillow path's draws)."""
        from PIL import Image

        try:
            with Image.open(io.BytesIO(encoded.tobytes())) as probe:  # the header: the size decides the box
                width, height = probe.size
        except Exception as e:  # any header failure: the file is named as the Pillow path names it
            found = self.data.explain(path, True) if self.data.explain is not None else None
            raise found or DataError(f"{path}: cannot decode image ({e})") from None
        g = item_generator(self.seed, self.epoch, index)
        left, top, right, bottom = random_resized_box(width, height, self.data.scale, self.data.ratio, g)
        flip = self.data.hflip > 0 and float(torch.rand((), generator=g)) < self.data.hflip
        return (np.array([left, top], np.float32), np.array([right - left, bottom - top], np.float32),
                np.array(int(flip), np.int32))


def _read(path: str) -> np.ndarray:
    try:
        return np.fromfile(path, dtype=np.uint8)
    except OSError as e:  # removed or unreadable since the listing
        raise DataError(f"{path}: cannot read image file ({e.strerror or e})") from None


def _graph(data: DaliImageFolder, source: _EpochSource, dali_device: str):
    """The pipeline's outputs ``(images uint8 (3, S, S) per sample, labels)`` (call inside a pipeline)."""
    from nvidia.dali import fn, types

    decoder = "mixed" if dali_device == "gpu" else "cpu"
    resize = dict(interp_type=types.INTERP_LINEAR, antialias=True)  # Pillow's BILINEAR (antialiased)
    s = data.image_size
    # EXIF orientation is not applied, as the Pillow path does not: the windows are in file pixels
    if data.train:
        jpegs, label, anchor, shape, mirror = fn.external_source(
            source=source, num_outputs=5, batch=True,
            dtype=[types.UINT8, types.INT64, types.FLOAT, types.FLOAT, types.INT32])
        images = fn.decoders.image_slice(jpegs, anchor, shape, device=decoder, output_type=types.RGB,
                                         normalized_anchor=False, normalized_shape=False, adjust_orientation=False)
        images = fn.resize(images, resize_x=s, resize_y=s, **resize)
    else:
        jpegs, label = fn.external_source(source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64])
        images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, adjust_orientation=False)
        shape = fn.peek_image_shape(jpegs, dtype=types.FLOAT, adjust_orientation=False)
        start, end = _center_roi(shape, s, data.resize_size)
        images = fn.resize(images, size=[s, s], roi_start=start, roi_end=end, roi_relative=True, **resize)
        mirror = 0
    images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=mirror)
    return images, (label.gpu() if dali_device == "gpu" else label)


class DaliLoader:
    """Iterates ``{"image": uint8 (B, 3, S, S), "label": int64 (B,)}`` batches of this rank's shard
    (on the GPU with ``dali_device`` gpu, else on the CPU); ``set_epoch`` before every epoch.

    The pipeline is built once (at the first iteration) and reset for each later epoch; a loop that
    leaves an epoch early has the batches DALI already prefetched drained at the next one.
    ``builds`` counts the pipelines built (one, unless an error invalidated the pipeline).
    """

    prefetch_depth = 2  # batches DALI runs ahead: its default prefetch_queue_depth (not set here)

    def __init__(self, data: DaliImageFolder, batch_size: int, shard_id: int, num_shards: int, seed: int,
                 dali_device: str, device: torch.device):
        self.data, self.batch_size, self.shard_id, self.num_shards = data, batch_size, shard_id, num_shards
        self.seed, self.dali_device, self.device, self.epoch, self.start_batch = seed, dali_device, device, 0, 0
        start, end = shard_bounds(len(epoch_order(len(data.samples), data.train, seed, 0, num_shards)), shard_id,
                                  num_shards)
        self.shard_len = end - start
        if data.train and self.shard_len == 0:
            raise ConfigError(f"{len(data.samples)} training images cannot be sharded over {num_shards} ranks")
        # training drops a partial last batch (as the Pillow path does) unless the shard is smaller
        self.drop_last = data.train and self.shard_len >= batch_size
        full, rest = divmod(self.shard_len, batch_size)
        self.batches = full if self.drop_last else full + (rest > 0)
        self.source = _EpochSource(data, batch_size, shard_id, num_shards, seed)
        self.builds = 0
        self._iterator: Any = None
        self._open = False  # an epoch was left before DALI said it ended

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """The next iteration reads epoch ``epoch``'s order and draws, from sample ``start_sample`` of
        the epoch, all shards together (a mid-epoch resume: the batches before it are not decoded)."""
        self.epoch, self.start_batch = epoch, start_sample // (self.batch_size * self.num_shards)

    def _build(self) -> Any:
        """Build the pipeline and its iterator (which runs the first batches of the started epoch)."""
        from nvidia.dali import pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        device_id = None
        if self.dali_device == "gpu":
            device_id = self.device.index if self.device.type == "cuda" and self.device.index is not None \
                else torch.cuda.current_device()

        @pipeline_def(batch_size=self.batch_size, num_threads=self.data.threads, device_id=device_id,
                      seed=pipeline_seed(self.seed, 0, self.shard_id))  # no DALI random operator draws from it
        def pipe():
            return _graph(self.data, self.source, self.dali_device)

        pipeline = pipe()
        pipeline.build()
        self.builds += 1
        return DALIGenericIterator([pipeline], ["image", "label"], auto_reset=False,
                                   last_batch_policy=LastBatchPolicy.PARTIAL)

    def _begin_epoch(self) -> None:
        if self._iterator is not None and self._open:  # the last epoch was left early
            self.source.stop()
            for _ in self._iterator:  # what DALI prefetched of it (up to its queue depth)
                pass
        self.source.start(self.epoch, self.start_batch, self.batches)
        if self._iterator is None:
            self._iterator = self._build()
        else:
            self._iterator.reset()
        self._open = True

    def __iter__(self):
        if self.start_batch >= self.batches:
            return
        try:
            self._begin_epoch()
            for out in self._iterator:
                self.source.pending.popleft()
                yield {"image": out[0]["image"], "label": out[0]["label"].view(-1).long()}
            self._open = False
        except RuntimeError as e:
            self._iterator, self._open = None, False  # DALI: "the pipeline object is no longer valid"
            found = decode_error(e, [f for files in self.source.pending for f in files], self.data)
            if found is None:
                raise
            raise found from None
        except Exception:  # e.g. the source's DataError: this pipeline is not reused
            self._iterator, self._open = None, False
            raise


def _detail(text: str) -> str:
    """What a DALI operator error says after "encountered:" (its first line), else the last line."""
    after = text.split("encountered:", 1)[1] if "encountered:" in text else text
    lines = [ln.strip() for ln in after.splitlines() if ln.strip() and "pipeline object is no longer valid" not in ln]
    return lines[0] if lines else type(text).__name__


def decode_error(err: Exception, files: list[str], data: DaliImageFolder) -> DataError | None:
    """The Pillow path's one-line error for a file DALI's decoder failed on, or None when ``err`` is
    not a decoding error (CUDA out of memory, another operator's error): then it propagates as is.

    A decoding error comes from a ``decoders`` operator, is not about memory, and names a file
    Pillow fails on too (``data.explain(path, full=True)``) among ``files`` (the batches in
    flight), or says the data does not decode (then the first in-flight file is named).
    """
    text = str(err)
    detail = _detail(text)
    if "fn.decoders." not in text or _MEMORY.search(text):
        return None
    if data.explain is not None:
        for path in files:
            found = data.explain(path, True)
            if found is not None:
                return found
    if not _UNDECODABLE.search(detail):
        return None
    where = files[0] if files else "?"
    return DataError(f"{where}: DALI cannot decode an image ({detail})")
