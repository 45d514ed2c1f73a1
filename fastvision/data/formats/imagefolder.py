"""ImageFolder / ImageNet layout (``train/<class>/*.JPEG``, ``val/<class>/*.JPEG``) for classification.

Decoding is Pillow with ``Image.draft``: a JPEG can be decoded directly at 1/2, 1/4 or 1/8 scale
by the DCT, so a 4000x3000 photo headed for a 224 crop never gets decoded at full size. The
crop and the resize are then one ``Image.resize(..., box=...)`` call. Training items get a
random-resized crop (area 8-100 %, aspect 3/4-4/3) and a horizontal flip; evaluation items get
the shorter side resized to 256 and a 224 centre crop (seed 004).

Items are ``{"image": uint8 (3, S, S), "label": int64 scalar, "id": str}``: uint8 crosses the
host-to-device link at a quarter of float32's bytes and the task normalises on the device.
``dataset[i]`` is deterministic (the evaluation view). A training split is read through
:meth:`ImageFolderDataset.cache_pipeline`: the file's bytes are the cacheable prefix and
:class:`RandomResizedCrop` decodes them per item with a generator of (seed, epoch, sample index),
so the crop still chooses the DCT scale before decoding.
"""
from __future__ import annotations

import functools
import io
import logging
import math
import os
import unicodedata
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from fastvision.data.formats.anomalies import (
    drop_unreadable,
    first_few,
    handle_invalid,
    image_decodes,
    image_header,
)
from fastvision.data.formats.base import DatasetSplits, dataset_folder
from fastvision.data.formats.imagenet_val import flat_val_layout, flat_val_samples
from fastvision.data.transforms import (  # noqa: F401  (random_resized_box: also the DALI path's)
    RandomTransform,
    ReadBytes,
    Transform,
    center_box,
    random_resized_box,
    random_resized_crop_draws,
)
from fastvision.errors import ConfigError, DataError
from fastvision.registry import DATASETS

log = logging.getLogger(__name__)
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".tif", ".tiff", ".webp")


def find_classes(root: Path) -> list[str]:
    """Sorted class folder names under ``root``; DataError if ``root`` is missing or has none."""
    if not root.is_dir():
        raise DataError(f"image folder not found: {root}")
    classes = sorted((p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda name: unicodedata.normalize("NFC", name))  # a macOS (decomposed) copy sorts alike
    if not classes:
        raise DataError(f"{root}: no class folders (expected {root}/<class>/<image>)")
    return classes


def list_samples(root: Path, classes: list[str], extensions: tuple[str, ...] = EXTENSIONS) -> list[tuple[str, int]]:
    """``(path, class index)`` for every image under ``root/<class>/``, in sorted order.

    Sub-folders of a class folder are read too, as torchvision's ImageFolder does (Tiny-ImageNet's
    ``train/<wnid>/images/``); hidden files and folders are not.

    Raises:
        DataError: a class folder is missing or holds no image with one of ``extensions``.
    """
    samples = []
    for idx, name in enumerate(classes):
        d = root / name
        if not d.is_dir():
            raise DataError(f"{d}: class folder missing (classes come from the training split)")
        files = sorted(_images_under(d, extensions))
        if not files:
            raise DataError(f"{d}: no images with extensions {', '.join(extensions)}")
        samples += [(f, idx) for f in files]
    return samples


def _images_under(folder: Path, extensions: tuple[str, ...]) -> list[str]:
    """Image files under ``folder`` and its sub-folders, linked ones included; names starting with "."
    are skipped ("._x.JPEG" are macOS metadata companions, not images). A linked folder is read
    once, and one that leads back to ``folder`` or above it (``loop -> ..``) is not read: os.walk
    follows such a link 40 levels deep, taking every image again and the other classes' under this
    one's label (one warning names the links left out)."""
    top = os.path.realpath(folder)
    seen, loops, out = set(), [], []
    for here, dirs, names in os.walk(folder, followlinks=True):
        seen.add(os.path.realpath(here))
        keep = []
        for d in dirs:
            if d.startswith("."):
                continue
            real = os.path.realpath(os.path.join(here, d))
            if real in seen or real == top or top.startswith(real.rstrip(os.sep) + os.sep):
                loops.append(os.path.join(here, d))
                continue
            seen.add(real)
            keep.append(d)
        dirs[:] = keep
        out += [os.path.join(here, n) for n in names
                if not n.startswith(".") and os.path.splitext(n)[1].lower() in extensions]
    if loops:
        log.warning("%s: %d linked folder(s) not read, they lead to a folder read already (a link loop, or a "
                    "second link to one): %s", folder, len(loops), ", ".join(loops[:3]))
    return out


def loose_images(split_dir: Path) -> list[str]:
    """Image files lying in ``split_dir`` itself, beside its class folders: no folder labels them, so
    they are not read (an ImageNet ``valprep.sh`` stopped half-way leaves the rest of val so)."""
    return sorted(p.name for p in split_dir.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in EXTENSIONS)


def check_crop_args(image_size: int = 224, resize_size: int = 256, scale: tuple[float, float] = (0.08, 1.0),
                    ratio: tuple[float, float] = (3 / 4, 4 / 3), hflip: float = 0.5, **_: Any) -> None:
    """One-line :class:`ConfigError` naming the ``data.args`` key whose crop setting no image can
    take (a side below 1, an area fraction outside (0, 1], a range given high-low, a flip
    probability outside [0, 1]), before anything is read; other keyword arguments are ignored."""
    for key, side in (("image_size", image_size), ("resize_size", resize_size)):
        if side < 1:
            raise ConfigError(f"data.args.{key}={side}: a side in pixels, at least 1")
    lo, hi = scale
    if not 0 < lo <= hi <= 1:
        raise ConfigError(f"data.args.scale={[lo, hi]}: the crop's area fraction [min, max], "
                          "0 < min <= max <= 1 (seed 004's code: [0.05, 1.0]; its README: [0.08, 1.0])")
    lo, hi = ratio
    if not 0 < lo <= hi:
        raise ConfigError(f"data.args.ratio={[lo, hi]}: the crop's aspect (width / height) [min, max], "
                          "0 < min <= max (seed 004: [0.75, 1.333])")
    if not 0 <= hflip <= 1:
        raise ConfigError(f"data.args.hflip={hflip}: a probability, 0 to 1")


def open_image(path: str, draft_size: tuple[int, int] | None = None) -> Image.Image:
    """Open an image as RGB, decoding JPEGs at the smallest DCT scale still >= ``draft_size``.

    Args:
        path: image file.
        draft_size: (width, height) the *whole* image must keep after reduced decoding, or None.
    """
    try:
        img = Image.open(path)  # the format comes from the content: a PNG named .JPEG opens as PNG
        if draft_size is not None and img.format == "JPEG":
            img.draft("RGB", draft_size)  # a CMYK JPEG stays CMYK here (reduced scale only)
        if img.mode.startswith("I;16"):  # 16-bit grey (PNG, TIFF): Pillow's convert clips at 255
            img = Image.fromarray(((np.asarray(img, dtype=np.uint32) * 255 + 32767) // 65535).astype(np.uint8))
        return img.convert("RGB")  # grey, CMYK (Adobe inverted included), palette, RGBA -> RGB
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{path}: cannot decode image ({e})") from e


def load_crop(path: str | bytes | memoryview, train: bool, size: int, resize: int, scale: tuple[float, float],
              ratio: tuple[float, float], hflip: float, generator: torch.Generator | None = None,
              name: str | None = None) -> np.ndarray:
    """Decode, crop and resize one image to a ``(size, size, 3)`` uint8 array.

    Args:
        path: image file, or its encoded bytes (from a cache).
        train: random-resized crop and flip drawn from ``generator``; else resize + centre crop.
        name: the file named in errors when ``path`` is bytes.
    """
    name = name or str(path)
    src = io.BytesIO(path) if isinstance(path, (bytes, memoryview)) else path
    try:
        with Image.open(src) as probe:  # header only: the size decides the crop and the draft scale
            width, height = probe.size
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{name}: cannot decode image ({_why(e, src)})") from e
    flip = False
    if train:
        box, flip = random_resized_crop_draws(width, height, scale, ratio, hflip, generator)
    else:
        box = center_box(width, height, resize, size)
    # keep at least `size` output pixels per box side after the DCT-scale reduction
    f = max((box[2] - box[0]) / size, (box[3] - box[1]) / size, 1.0)
    if not isinstance(src, (str, Path)):
        src.seek(0)
    try:
        img = open_image(src, (math.ceil(width / f), math.ceil(height / f)))
    except DataError as e:
        raise DataError(f"{name}: cannot decode image ({_why(e.__cause__, src)})") from e
    sx, sy = img.width / width, img.height / height
    box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    img = img.resize((size, size), Image.BILINEAR, box=box)
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy needs one


def _why(e: BaseException | None, src: Any) -> str:
    """Pillow's reason, without the ``<_io.BytesIO object at 0x...>`` it names bytes by (the
    message names the file)."""
    return str(e).replace(f" {src!r}", "") if isinstance(src, io.BytesIO) else str(e)


def pillow_error(path: str, full: bool, size: int, resize: int) -> DataError | None:
    """The error the Pillow path raises for ``path`` (reading its header, or with ``full`` its
    evaluation item), or None when Pillow reads it: how the DALI backend names a bad file."""
    try:
        if full:
            load_crop(path, False, size, resize, (1.0, 1.0), (1.0, 1.0), 0.0)
        else:
            image_header(Path(path))
    except DataError as e:
        return e
    except Exception as e:  # any decoder failure (truncated data surfaces at resize time)
        return DataError(f"{path}: cannot decode image ({e})")
    return None


class RandomResizedCrop(RandomTransform):
    """Random-resized crop + horizontal flip of encoded bytes, drawn from the item's generator."""

    def __init__(self, size: int, scale: tuple[float, float], ratio: tuple[float, float], hflip: float):
        self.size, self.scale, self.ratio, self.hflip = size, tuple(scale), tuple(ratio), hflip

    def __call__(self, item: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        try:
            arr = load_crop(item["data"].cpu().numpy().tobytes(), True, self.size, 0, self.scale, self.ratio,
                            self.hflip, generator, name=item["id"])
        except (UnidentifiedImageError, OSError) as e:  # truncated data surfaces at resize time
            raise DataError(f"{item['id']}: cannot decode image ({e})") from e
        return {"image": torch.from_numpy(arr).permute(2, 0, 1).contiguous(),
                "label": torch.tensor(item["label"], dtype=torch.int64), "id": item["id"]}


class ImageFolderDataset(Dataset):
    """Classification items from ``(path, class index)`` pairs.

    ``dataset[i]`` is deterministic (resize + centre crop); a training split (``train=True``) is
    read through :meth:`cache_pipeline` (random-resized crop + flip per item).

    Args:
        samples: ``(path, label)`` list (see :func:`list_samples`).
        train: the split is trained on.
        image_size: output side S (224 for ImageNet).
        resize_size: evaluation shorter side before the centre crop (256 for ImageNet).
        scale: training crop area fraction range.
        ratio: training crop aspect (w/h) range.
        hflip: probability of a horizontal flip in training.
    """

    def __init__(self, samples: list[tuple[str, int]], train: bool, image_size: int = 224, resize_size: int = 256,
                 scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 hflip: float = 0.5):
        self.samples = samples
        self.train = train
        self.image_size = image_size
        self.resize_size = resize_size
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.hflip = hflip

    def __len__(self) -> int:
        return len(self.samples)

    def identity(self, i: int) -> str:
        from fastvision.data.cache.select import files_identity

        return files_identity([self.samples[i][0]])

    def cache_pipeline(self) -> tuple[Dataset, list]:
        """``(indices, [read bytes, RandomResizedCrop])``: caches hold encoded files."""
        from fastvision.data.cache.select import _Indices

        return _Indices(len(self), self.identity), [ReadBytes(self.samples),
                                                    RandomResizedCrop(self.image_size, self.scale, self.ratio,
                                                                      self.hflip)]

    def __getitem__(self, i: int) -> dict:
        path, label = self.samples[i]
        try:
            arr = load_crop(path, False, self.image_size, self.resize_size, self.scale, self.ratio, self.hflip)
        except (UnidentifiedImageError, OSError) as e:  # truncated data surfaces at resize time
            raise DataError(f"{path}: cannot decode image ({e})") from e
        image = torch.from_numpy(arr).permute(2, 0, 1).contiguous()
        return {"image": image, "label": torch.tensor(label, dtype=torch.int64), "id": path}


def _class_folder_val(val_root: Path, classes: list[str], train_dir: str) -> list[tuple[str, int]]:
    """``val/<class>/*`` samples labelled by the training class list (val may lack a class)."""
    val_classes = find_classes(val_root)
    nfc = functools.partial(unicodedata.normalize, "NFC")  # macOS writes names decomposed: 'café' is 'cafe' + U+0301
    present = set(map(nfc, val_classes))
    extra = sorted(present - set(map(nfc, classes)))
    if extra:
        raise DataError(f"{val_root}: classes not in {train_dir}/: {', '.join(extra[:5])}")
    missing = [c for c in classes if nfc(c) not in present]
    if missing:  # the metrics then leave these classes out: said once, as data inspect says it
        log.warning("%s: %d of the %d %s/ classes have no folder here and are not validated: %s", val_root,
                    len(missing), len(classes), train_dir, first_few(missing))
    index = {nfc(c): i for i, c in enumerate(classes)}
    return [(p, index[nfc(val_classes[j])]) for p, j in list_samples(val_root, val_classes)]


def _train_classes(root: Path, train_dir: str, val_dir: str) -> list[str]:
    """The class folders of ``root/train_dir``; one line when ``root`` is the split (or a class) folder,
    or the pathology layout (images/ and masks/), not one folder per class."""
    if not (root / train_dir).is_dir():  # --data given the split (or a class) folder, not the one above
        up = next((a for a in (root, *root.parents) if a.name == train_dir), None)
        hint = f"; did you mean --data {up.parent}?" if up is not None else ""
        raise DataError(f"{root}: no {train_dir}/ folder: --data (data.args.path) is the folder holding "
                        f"{train_dir}/ and {val_dir}/, each with one folder per class{hint}")
    classes = find_classes(root / train_dir)
    if {"images", "masks"} <= set(classes) and set(classes) <= {"images", "masks", "annotations"}:
        raise DataError(f"{root / train_dir}: its folders are {', '.join(c + '/' for c in classes)}: images and their "
                        "masks (the pathology layout: recipe resnet18-pathology, data.name=pathology), not one "
                        "folder per class; as an ImageFolder its classes would be 'images' and 'masks'")
    return classes


def _val_split(root: Path, val_root: Path, classes: list[str], train_dir: str, val_labels: str | None,
               invalid: str) -> tuple[list, str]:
    """(samples, layout) of the validation split: a flat folder and its labels file, or class folders."""
    if not val_root.is_dir():  # Kaggle's and others' validation/, valid/, test/: name the key that picks it
        here = ", ".join(sorted(p.name + "/" for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")))
        raise DataError(f"{val_root}: no validation folder (folders in {root}: {here}); name yours with "
                        f"--set data.args.val_dir=NAME")
    flat = flat_val_layout(val_root, EXTENSIONS)
    if flat:  # ImageNet's val as distributed (one folder + a labels file), or Tiny-ImageNet's
        return flat_val_samples(flat[0], classes, root, EXTENSIONS, val_labels or flat[1], invalid)
    if val_labels:  # said once: a recipe's labels file that this layout does not read
        log.warning("data.args.val_labels=%s is not used: %s is sorted into class folders, which label it",
                    val_labels, val_root)
    return _class_folder_val(val_root, classes, train_dir), "class folders"


@DATASETS.register("imagefolder")
def build(*, path: str, train_dir: str = "train", val_dir: str = "val", image_size: int = 224,
          resize_size: int = 256, scale: tuple[float, float] = (0.08, 1.0),
          ratio: tuple[float, float] = (0.75, 4 / 3), hflip: float = 0.5,
          backend: Literal["pillow", "dali", "nvjpeg"] = "pillow", dali_device: Literal["cpu", "gpu", "auto"] = "auto",
          dali_threads: int | None = None, nvjpeg_threads: int | None = None, val_labels: str | None = None,
          invalid: Literal["warn", "error"] = "warn", skip_unreadable: bool = False) -> DatasetSplits:
    """ImageFolder train/val splits.

    Args:
        path: root holding ``train_dir`` and ``val_dir``, each with one folder per class.
        train_dir: training split folder name.
        val_dir: validation split folder name (ImageNet's ``val`` must be sorted into classes).
        image_size: crop side S of the items (3, S, S).
        resize_size: evaluation shorter side before centre-cropping ``image_size``.
        scale: random-resized-crop area range (seed 004: 0.08-1.0).
        ratio: random-resized-crop aspect range.
        hflip: horizontal flip probability in training.
        backend: ``pillow`` (default), ``dali`` (NVIDIA DALI's own reader, fused decode + crop and
            loader; ``pip install -e ".[dali]"``; see :mod:`fastvision.data.dali`), or ``nvjpeg``
            (torchvision's batched nvJPEG decode on the GPU; see :mod:`fastvision.data.gpu_decode`).
        dali_device: DALI decodes on ``cpu`` (libjpeg-turbo), ``gpu`` (nvJPEG) or ``auto`` (gpu
            when the run's device is CUDA).
        dali_threads: DALI CPU threads per pipeline (None: the CPU count, at most 8).
        nvjpeg_threads: ``backend: nvjpeg`` (torchvision's batched nvJPEG decode on the GPU; see
            :mod:`fastvision.data.gpu_decode`): host threads reading files and JPEG headers (None:
            the CPU count, at most 8).
        val_labels: labels of a flat ``val_dir`` (ImageNet as distributed; see
            :mod:`.imagenet_val`): found automatically when None.
        invalid: flat val entries without a usable label: "warn" skips them with one warning,
            "error" stops.
        skip_unreadable: skip (with one warning) images whose header does not decode, instead of
            stopping at the first with an error naming it.
    """
    check_crop_args(image_size, resize_size, scale, ratio, hflip)
    root = dataset_folder(path)
    classes = _train_classes(root, train_dir, val_dir)
    train = list_samples(root / train_dir, classes)
    val_root = root / val_dir
    val, val_layout = _val_split(root, val_root, classes, train_dir, val_labels, invalid)
    for split in [root / train_dir] + ([val_root] if val_layout == "class folders" else []):  # never without a word
        handle_invalid(split, {"image files beside the class folders": loose_images(split)}, invalid,
                       what="images not read (no class folder labels them)")
    # a file without a readable header or its end (a truncated download): skipped, with one warning
    train = drop_unreadable(train, lambda s: [s[0]], image_decodes, skip_unreadable, root / train_dir)
    val = drop_unreadable(val, lambda s: [s[0]], image_decodes, skip_unreadable, val_root)
    kw = dict(image_size=image_size, resize_size=resize_size, scale=scale, ratio=ratio, hflip=hflip)
    info = {"classes": classes, "num_classes": len(classes), "train_images": len(train), "val_images": len(val),
            "val_layout": val_layout}
    if backend == "dali":
        from fastvision.data.dali import DaliImageFolder

        explain = functools.partial(pillow_error, size=image_size, resize=resize_size)
        dkw = dict(kw, dali_device=dali_device, threads=dali_threads, explain=explain)
        return DatasetSplits(DaliImageFolder(train, train=True, **dkw), DaliImageFolder(val, train=False, **dkw), info)
    if backend == "nvjpeg":
        from fastvision.data.gpu_decode import NvjpegImageFolder

        return DatasetSplits(NvjpegImageFolder(train, train=True, threads=nvjpeg_threads, **kw),
                             NvjpegImageFolder(val, train=False, threads=nvjpeg_threads, **kw), info)
    return DatasetSplits(ImageFolderDataset(train, True, **kw), ImageFolderDataset(val, False, **kw), info)
