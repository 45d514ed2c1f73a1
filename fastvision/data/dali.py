"""Optional NVIDIA DALI input pipeline for ImageFolder data (``data.args.backend: dali``).

Seed 004 decodes JPEGs on the GPU with DALI: the file reader shards by rank, ``mixed`` decoding
fuses the random-resized crop into the decoder (nvJPEG), and resize + flip happen on the device.
Batches come out as uint8 (B, 3, S, S) CUDA tensors, exactly like the Pillow path's items after
collation, so the classification task normalises them the same way.

DALI is not a dependency: without it, asking for this backend is a one-line ``ConfigError``. This
module was written against DALI's documented Python API (readers.file, decoders.image_random_crop,
resize, crop_mirror_normalize, DALIGenericIterator) and has not run in this project's CI, which has
no GPU; the Pillow backend is the tested default.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fastvision.errors import ConfigError


def require_dali() -> Any:
    try:
        import nvidia.dali as dali  # noqa: F401
        from nvidia.dali.plugin import pytorch as dali_torch  # noqa: F401
    except ImportError:
        raise ConfigError("data.args.backend=dali needs NVIDIA DALI (install nvidia-dali-cudaXXX for your CUDA "
                          "version from NVIDIA's package index), or use the default backend: pillow") from None
    if not torch.cuda.is_available():
        raise ConfigError("data.args.backend=dali decodes on the GPU and needs a CUDA device")
    return dali


class DaliImageFolder:
    """A list of (path, label) samples that builds its own DALI loader.

    The engine calls :meth:`make_loader` instead of wrapping the dataset in a sampler: DALI's
    reader shards by (shard_id, num_shards) itself and keeps a partial last batch without padded
    duplicates for validation, so metrics stay exact across ranks.
    """

    def __init__(self, samples: list[tuple[Path, int]], *, train: bool, image_size: int, resize_size: int,
                 scale: tuple[float, float], ratio: tuple[float, float], hflip: float):
        require_dali()
        self.samples, self.train = samples, train
        self.image_size, self.resize_size = image_size, resize_size
        self.scale, self.ratio, self.hflip = tuple(scale), tuple(ratio), hflip

    def __len__(self) -> int:
        return len(self.samples)

    def make_loader(self, *, batch_size: int, shard_id: int, num_shards: int, seed: int, device: torch.device,
                    num_threads: int = 4) -> "DaliLoader":
        return DaliLoader(self, batch_size, shard_id, num_shards, seed, device, num_threads)


class DaliLoader:
    """Iterates dict batches ``{"image": uint8 (B, 3, S, S) cuda, "label": int64 (B,) cuda}``."""

    def __init__(self, data: DaliImageFolder, batch_size: int, shard_id: int, num_shards: int, seed: int,
                 device: torch.device, num_threads: int):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        device_id = device.index if device.index is not None else torch.cuda.current_device()
        files = [str(p) for p, _ in data.samples]
        labels = [int(y) for _, y in data.samples]

        # a seed per shard: ranks draw different crops and flips for their samples
        @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed + shard_id)
        def pipe():
            jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=data.train,
                                           shard_id=shard_id, num_shards=num_shards, pad_last_batch=not data.train,
                                           name="Reader")
            if data.train:
                images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                                       random_area=list(data.scale),
                                                       random_aspect_ratio=list(data.ratio))
                images = fn.resize(images, resize_x=data.image_size, resize_y=data.image_size)
                mirror = fn.random.coin_flip(probability=data.hflip)
            else:
                images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
                images = fn.resize(images, resize_shorter=data.resize_size)
                mirror = 0
            images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                              crop=(data.image_size, data.image_size), mirror=mirror)
            return images, label.gpu()

        self.pipeline = pipe()
        self.pipeline.build()
        policy = LastBatchPolicy.DROP if data.train else LastBatchPolicy.PARTIAL
        self.iterator = DALIGenericIterator([self.pipeline], ["image", "label"], reader_name="Reader",
                                            last_batch_policy=policy, auto_reset=True)

    def __len__(self) -> int:
        return len(self.iterator)

    def set_epoch(self, epoch: int) -> None:
        """DALI's reader reshuffles every epoch from its own seeded state."""

    def __iter__(self):
        for out in self.iterator:
            batch = out[0]
            yield {"image": batch["image"], "label": batch["label"].view(-1).long()}
