"""JPEG decoding on the GPU with torchvision's batched nvJPEG decoder (``data.args.backend: nvjpeg``).

For a machine that has torchvision but not DALI. The loader's threads read, per item, only the
encoded file, its label and its crop: the header gives the size, and a training crop and flip are
drawn from the generator of ``(seed, epoch, sample index)`` by the Pillow path's own sampler
(:func:`~fastvision.data.transforms.random_resized_crop_draws`), so a sample is cropped where the
Pillow path crops it; validation takes the Pillow path's centre box
(:func:`~fastvision.data.transforms.center_box`). Batches go through the Pillow path's
sampler (:class:`~fastvision.distributed.TrainSampler`, per rank): the same batches as with Pillow.

On the device, one ``torchvision.io.decode_jpeg(list, device="cuda")`` call decodes a batch
(baseline JPEGs on the A100 / H100 hardware decoder), then :func:`resample` crops and resizes each
image with the arithmetic of Pillow's ``Image.resize(size, BILINEAR, box=...)`` (the same
antialiased triangle filter, fractional box, taps outside the box up to the image edge; the flip
folded into the weights), as two matrix products per image: within 1 grey level of Pillow on the
same pixels (Pillow rounds after each pass, this path once). Batches are ``{"image": uint8
(B, 3, S, S), "label": int64 (B,)}`` on the GPU like the other backends', so the task makes them
float, in the layout ``train.channels_last`` asks for, and normalises them on the device as for
every backend. Decoding runs a batch or two ahead in a background thread on its own CUDA stream,
beside the training step.

What differs from the Pillow path: the IDCT (nvJPEG's, and always at full scale, where Pillow may
decode a large JPEG at 1/2-1/8 scale first) and rounding (one rounding instead of Pillow's per
pass). Files nvJPEG cannot take (CMYK, PNG named .JPEG, a failed decode) are decoded by Pillow as
the Pillow path does and sent up; a file neither reads is named in the Pillow path's DataError.

Like DALI this dataset brings its own loader (``make_loader``): ``data.cache`` stays ``none``.
torchvision is imported when the backend is chosen, and a missing torchvision or CUDA is a
one-line ConfigError naming ``data.args.backend``.
"""
from __future__ import annotations

import io
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastvision.data.transforms import (
    RandomTransform,
    ReadBytes,
    Transform,
    center_box,
    random_resized_crop_draws,
)
from fastvision.errors import ConfigError, DataError

log = logging.getLogger(__name__)
_NVJPEG_MODES = ("RGB", "L")  # JPEG colour modes nvJPEG decodes to RGB (CMYK goes through Pillow)


def require_decoder() -> Callable:
    """``torchvision.io.decode_jpeg`` where torchvision and CUDA are there, else a one-line ConfigError."""
    try:
        import torchvision
        from torchvision.io import decode_jpeg
    except (ImportError, OSError, RuntimeError) as e:  # absent, or built for another torch
        raise ConfigError(f"data.args.backend=nvjpeg needs torchvision (>= 0.19, batched nvJPEG decoding) and "
                          f"torchvision is not importable ({type(e).__name__}: {e}); use backend: pillow") from None
    if tuple(int(x) for x in torchvision.__version__.split("+")[0].split(".")[:2]) < (0, 19):
        raise ConfigError(f"data.args.backend=nvjpeg needs torchvision >= 0.19 (batched nvJPEG decoding), found "
                          f"{torchvision.__version__}; use backend: pillow")
    if not torch.cuda.is_available():
        raise ConfigError("data.args.backend=nvjpeg decodes on the GPU and needs CUDA (torch.cuda.is_available() is "
                          "False); use backend: pillow")
    return decode_jpeg


def _header(data: torch.Tensor, name: str) -> tuple[int, int, bool]:
    """``(width, height, nvjpeg)`` of encoded bytes; ``nvjpeg``: a JPEG nvJPEG decodes to RGB."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as probe:
            return probe.width, probe.height, probe.format == "JPEG" and probe.mode in _NVJPEG_MODES
    except Exception as e:  # any header failure is the file's: named as the Pillow path names it
        raise DataError(f"{name}: cannot decode image ({e})") from None


class CenterWindow(Transform):
    """Validation: the Pillow path's box of "shorter side -> ``resize``, centre crop ``size``"."""

    def __init__(self, size: int, resize: int):
        self.size, self.resize = size, resize

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        w, h, nvjpeg = _header(item["data"], item["id"])
        return {**item, "box": center_box(w, h, self.resize, self.size), "flip": False, "size": (w, h),
                "nvjpeg": nvjpeg}


class RandomWindow(RandomTransform):
    """Training: the Pillow path's random-resized-crop box and flip, drawn from the item's generator."""

    def __init__(self, scale: tuple[float, float], ratio: tuple[float, float], hflip: float):
        self.scale, self.ratio, self.hflip = tuple(scale), tuple(ratio), hflip

    def __call__(self, item: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        w, h, nvjpeg = _header(item["data"], item["id"])
        box, flip = random_resized_crop_draws(w, h, self.scale, self.ratio, self.hflip, generator)
        return {**item, "box": box, "flip": flip, "size": (w, h), "nvjpeg": nvjpeg}


def collate_encoded(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Host batch: ``data`` (list of uint8 1-D), ``box`` float64 (B, 4) (left, top, right, bottom in
    file pixels), ``flip`` bool (B,), ``size`` int64 (B, 2) (width, height), ``nvjpeg`` (list of
    bool), ``label`` int64 (B,), ``id`` (list of paths)."""
    return {"data": [it["data"] for it in items],
            "box": torch.tensor([it["box"] for it in items], dtype=torch.float64).view(-1, 4),
            "flip": torch.tensor([bool(it["flip"]) for it in items], dtype=torch.bool),
            "size": torch.tensor([it["size"] for it in items], dtype=torch.int64).view(-1, 2),
            "nvjpeg": [bool(it["nvjpeg"]) for it in items],
            "label": torch.tensor([int(it["label"]) for it in items], dtype=torch.int64),
            "id": [it["id"] for it in items]}


def host_dataset(samples: list[tuple[str, int]], train: bool, *, image_size: int, resize_size: int,
                 scale: tuple[float, float], ratio: tuple[float, float], hflip: float, seed: int = 0):
    """The host side of the items: encoded bytes + label, then the crop window (random for training,
    from generators of ``(seed, epoch, sample index)`` as the Pillow path's pipeline draws them)."""
    from fastvision.data.cache.datasets import Pipeline
    from fastvision.data.cache.select import _Indices

    window = RandomWindow(scale, ratio, hflip) if train else CenterWindow(image_size, resize_size)
    pipe = Pipeline(_Indices(len(samples)), [ReadBytes(samples), window])
    pipe.seed = seed
    return pipe


def host_loader(dataset, train: bool, *, batch_size: int, shard_id: int, num_shards: int, seed: int, threads: int):
    """This rank's host batches (:func:`collate_encoded`) in the Pillow path's order: training by the
    ``(seed, epoch)`` :class:`TrainSampler` of whole global batches (``full_batches``, as
    ``engine.build.train_sampler``), validation by contiguous unpadded :class:`EvalSampler` shards."""
    from fastvision.data.loader import ThreadLoader
    from fastvision.distributed import EvalSampler, TrainSampler

    if train:
        sampler = TrainSampler(len(dataset), num_replicas=num_shards, rank=shard_id, seed=seed, shuffle=True,
                               batch_size=batch_size, full_batches=True)
        drop_last = len(sampler) >= batch_size
    else:
        sampler, drop_last = EvalSampler(len(dataset), num_replicas=num_shards, rank=shard_id), False
    return ThreadLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_encoded,
                        num_workers=threads, drop_last=drop_last)


def _axis_bounds(start: float, end: float, in_size: int, out: int) -> tuple[int, int]:
    """``[lo, hi)``: the input pixels Pillow's bilinear filter reads for the output of box ``[start, end)``."""
    scale = (end - start) / out
    support = max(scale, 1.0)  # the triangle's support (1) widened by the downscale factor
    lo = max(int(start + 0.5 * scale - support + 0.5), 0)  # int(): C's truncation, as Pillow rounds
    hi = min(int(start + (out - 0.5) * scale + support + 0.5), in_size)
    return lo, hi


def axis_weights(starts: torch.Tensor, ends: torch.Tensor, bounds: list[tuple[int, int]], out: int,
                 flips: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Pillow's antialiased bilinear weights along one axis for a batch, stacked image after image.

    Args:
        starts, ends: float64 (B,) box edges along the axis, in input pixels.
        bounds: per image ``[lo, hi)`` of :func:`_axis_bounds`.
        out: output length S.
        flips: bool (B,): output reversed (a horizontal flip, folded into the weights).

    Returns:
        ``(w, offsets)``: ``w`` float32 (sum of (hi - lo), S); image b's rows ``offsets[b]`` ..
        ``offsets[b] + hi - lo`` weigh input pixels ``lo`` .. ``hi - 1`` for each output; each
        output's weights sum to 1.
    """
    sizes = [hi - lo for lo, hi in bounds]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
    total, n = int(sum(sizes)), len(sizes)
    # per-image numbers on the host (float64, B x S), then one copy; the (rows, S) work in float32 on
    # coordinates relative to each image's first row, small enough to stay exact to ~1e-5 pixel
    scale = (ends - starts) / out
    i = torch.arange(out, dtype=torch.float64)
    i = torch.where(flips.cpu()[:, None], out - 1 - i, i)
    lo = torch.tensor([b[0] for b in bounds], dtype=torch.float64)
    center = (starts[:, None] + (i + 0.5) * scale[:, None] - lo[:, None]).float()  # (B, S), from lo
    inv = (1.0 / scale.clamp(min=1.0)).float()
    taps = 2 * int(np.ceil(float(scale.max()) if n else 1.0)) + 2  # a filter's taps, at most (host numbers)
    host = torch.cat([center, inv[:, None], torch.tensor([offsets, sizes], dtype=torch.float32).T], 1)
    host = host.to(device, non_blocking=True)
    center, inv, off, size = host[:, :out], host[:, out], host[:, out + 1], host[:, out + 2]
    img = torch.repeat_interleave(torch.arange(n, device=device),
                                  torch.tensor(sizes).to(device, non_blocking=True), output_size=total)
    pos = torch.arange(total, device=device, dtype=torch.float32) - off[img]  # each row's pixel, from lo
    w = (pos[:, None] + 0.5 - center[img]).mul_(inv[img, None]).abs_().neg_().add_(1).clamp_(min=0)
    # each output's sum over its few taps (B, S, K), not a scatter over the rows: deterministic on CUDA
    j = (center - 1 / inv[:, None]).floor()[..., None] + torch.arange(taps, device=device)
    t = ((j + 0.5 - center[..., None]) * inv[:, None, None]).abs_().neg_().add_(1).clamp_(min=0)
    sums = t.mul_((j >= 0) & (j < size[:, None, None])).sum(-1)
    return w.div_(sums.clamp_(min=1e-12)[img]), offsets


def resample(images: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, out: int) -> torch.Tensor:
    """Crop, resize and flip decoded images as Pillow's ``resize((S, S), BILINEAR, box=box)`` then
    ``FLIP_LEFT_RIGHT`` does, on the images' device.

    Args:
        images: uint8 (3, H_b, W_b) per image.
        boxes: float64 (B, 4) ``(left, top, right, bottom)`` in pixels (fractional allowed).
        flips: bool (B,) horizontal flips.
        out: output side S.

    Returns:
        float32 (B, 3, S, S) in 0-255 units, unrounded.
    """
    device = images[0].device
    bx = [_axis_bounds(b[0], b[2], im.shape[2], out) for b, im in zip(boxes.tolist(), images, strict=True)]
    by = [_axis_bounds(b[1], b[3], im.shape[1], out) for b, im in zip(boxes.tolist(), images, strict=True)]
    wx, ox = axis_weights(boxes[:, 0], boxes[:, 2], bx, out, flips, device)
    wy, oy = axis_weights(boxes[:, 1], boxes[:, 3], by, out, torch.zeros_like(flips), device)
    result = torch.empty(len(images), 3, out, out, device=device)
    for b, im in enumerate(images):
        (x0, x1), (y0, y1) = bx[b], by[b]
        rows = im[:, y0:y1, x0:x1].float() @ wx[ox[b]:ox[b] + x1 - x0]  # (3, h, S): the horizontal pass
        torch.matmul(wy[oy[b]:oy[b] + y1 - y0].T, rows, out=result[b])  # (S, h) @ (3, h, S): the vertical pass
    return result


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest level and clamp to 0-255, as Pillow's 8-bit output."""
    return x.round_().clamp_(0, 255).to(torch.uint8)


def pillow_decode(data: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """uint8 (3, H, W) on ``device`` decoded by Pillow at full scale, as the Pillow path converts
    (grey, CMYK, palette -> RGB); a file Pillow cannot read is named in the Pillow path's DataError."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as img:  # the format from the content
            arr = np.array(img.convert("RGB"), dtype=np.uint8)  # grey, CMYK (Adobe inverted), palette -> RGB
    except Exception as e:  # unreadable, or truncated data surfacing when the pixels are read
        raise DataError(f"{name}: cannot decode image ({e})") from None
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous().to(device)


def decode_images(batch: dict[str, Any], device: torch.device, decode_jpeg: Callable | None) -> list[torch.Tensor]:
    """The batch's images, uint8 (3, H, W) on ``device``: the JPEGs nvJPEG takes in one batched call
    (one by one after a failure, to find the file), the rest and nvJPEG's failures by Pillow."""
    data, ids = batch["data"], batch["id"]
    out: list[torch.Tensor | None] = [None] * len(data)
    gpu = [i for i, ok in enumerate(batch["nvjpeg"]) if ok]
    if gpu:
        try:
            for i, im in zip(gpu, decode_jpeg([data[i] for i in gpu], mode="RGB", device=device), strict=True):
                out[i] = im
        except RuntimeError:  # "does not return partial results in case of an error": find the file
            for i in gpu:
                try:
                    out[i] = decode_jpeg(data[i], mode="RGB", device=device)
                except RuntimeError as e:
                    log.warning("%s: nvJPEG cannot decode it (%s); decoded by Pillow", ids[i], str(e).splitlines()[0])
    for i, im in enumerate(out):
        if im is None:
            out[i] = pillow_decode(data[i], ids[i], device)
    for i, (w, h) in enumerate(batch["size"].tolist()):
        if tuple(out[i].shape) != (3, h, w):
            raise DataError(f"{ids[i]}: decoded to {tuple(out[i].shape[1:])} pixels but its header says {(h, w)}")
    return out  # type: ignore[return-value]


def decode_batch(batch: dict[str, Any], size: int, device: torch.device, decode_jpeg: Callable | None) -> dict:
    """A host batch (:func:`collate_encoded`) -> ``{"image": uint8 (B, 3, S, S), "label", "id"}`` on ``device``."""
    images = decode_images(batch, device, decode_jpeg)
    image = to_uint8(resample(images, batch["box"], batch["flip"], size))
    return {"image": image, "label": batch["label"].to(device, non_blocking=True), "id": batch["id"]}


class NvjpegLoader:
    """This rank's ``{"image": uint8 (B, 3, S, S), "label": int64 (B,), "id"}`` batches on the GPU.

    The host loader's threads read files and draw crops; one background thread decodes and
    resamples each batch on a side stream, ``depth`` batches ahead of the consumer, whose
    stream waits on that batch's event (and records its tensors as used, for the allocator).
    """

    depth = 2  # batches decoded ahead

    def __init__(self, host: Any, size: int, device: torch.device, decode_jpeg: Callable):
        self.host, self.size, self.device, self.decode_jpeg = host, size, device, decode_jpeg
        self.sampler = getattr(host, "sampler", None)
        self._pool, self._stream = None, None  # made at the first epoch, kept

    def __len__(self) -> int:
        return len(self.host)

    @property
    def prefetch_depth(self) -> int:
        """Batches ready ahead of a consumer that paused (decoded, and read by the host threads):
        what a timer takes untimed (:func:`fastvision.data.loader.prefetch_depth`)."""
        from fastvision.data.loader import prefetch_depth

        return self.depth + prefetch_depth(self.host)[0]

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """Epoch ``epoch``'s order and crops, from sample ``start_sample`` of it (all ranks together)."""
        self.host.set_epoch(epoch, start_sample=start_sample)

    def _decode(self, batch: dict[str, Any]) -> tuple[dict[str, Any], torch.cuda.Event]:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            out = decode_batch(batch, self.size, self.device, self.decode_jpeg)
            done = torch.cuda.Event()
            done.record(self._stream)
        return out, done

    def __iter__(self):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastvision-nvjpeg")
            self._stream = torch.cuda.Stream(self.device)
        it = iter(self.host)
        pending: deque[Future] = deque()

        def ahead() -> None:
            batch = next(it, None)
            if batch is not None:
                pending.append(self._pool.submit(self._decode, batch))

        try:
            for _ in range(self.depth):
                ahead()
            while pending:
                out, done = pending.popleft().result()
                current = torch.cuda.current_stream(self.device)
                current.wait_event(done)
                for t in (out["image"], out["label"]):
                    t.record_stream(current)  # made on the side stream, used on this one
                ahead()
                yield out
        finally:
            wait(pending)  # a loop that left early: the decodes in flight finish, unused


class NvjpegImageFolder:
    """``(path, label)`` samples decoded on the GPU by torchvision's nvJPEG; builds its own loader.

    Args:
        samples: ``(path, class index)`` pairs (the Pillow path's list, checked the same way).
        train: random-resized crop + flip; else resize the shorter side + centre crop.
        image_size: output side S.
        resize_size: evaluation shorter side before the centre crop.
        scale, ratio: random-resized-crop area fraction and aspect (w/h) ranges.
        hflip: horizontal flip probability (training).
        threads: host threads reading files and headers (None: the CPUs this process may run
            on, at most 8).

    Raises:
        ConfigError: torchvision or CUDA is missing (:func:`require_decoder`).
    """

    def __init__(self, samples: list[tuple[str, int]], *, train: bool, image_size: int, resize_size: int,
                 scale: tuple[float, float], ratio: tuple[float, float], hflip: float, threads: int | None = None):
        from fastvision.data.dali import default_threads

        self.decode_jpeg = require_decoder()
        self.samples, self.train, self.image_size = samples, train, image_size
        self.kw = dict(image_size=image_size, resize_size=resize_size, scale=tuple(scale), ratio=tuple(ratio),
                       hflip=hflip)
        self.threads = threads or default_threads()

    def __len__(self) -> int:
        return len(self.samples)

    def report(self) -> str:
        """One line for logs and the data benchmark."""
        what = "random-resized crop + flip" if self.train else "centre crop"
        return (f"nvJPEG (torchvision) GPU decode, {what} resampled on the GPU; {self.threads} host threads: "
                f"{len(self)} files, not cached")

    def __getitem__(self, i: int) -> dict:
        raise ConfigError("data.args.backend=nvjpeg decodes whole batches on the GPU, items are not read one by one; "
                          "set data.cache: none and data.augment: {} (or use backend: pillow)")

    def make_loader(self, *, batch_size: int, shard_id: int, num_shards: int, seed: int,
                    device: torch.device) -> NvjpegLoader:
        """This rank's loader (the engine's ``make_loader`` seam for a dataset that shards itself)."""
        if torch.device(device).type != "cuda":
            raise ConfigError(f"data.args.backend=nvjpeg decodes on the GPU but the run's device is {device}; "
                              "use backend: pillow")
        data = host_dataset(self.samples, self.train, seed=seed, **self.kw)
        host = host_loader(data, self.train, batch_size=batch_size, shard_id=shard_id, num_shards=num_shards,
                           seed=seed, threads=self.threads)
        return NvjpegLoader(host, self.image_size, torch.device(device), self.decode_jpeg)
