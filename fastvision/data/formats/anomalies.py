"""What a reader does with inputs it cannot use: say so once, with counts and the first names.

Public archives carry known defects (degenerate COCO boxes, annotations of unknown images, macOS
``._`` companions, a file that does not decode). Readers collect them as ``{kind: [ids]}`` and
call :func:`handle_invalid`, which logs one warning naming the file, the count and the first ids
(``data.args.invalid: warn``, the default) or raises a one-line :class:`DataError`
(``invalid: error``); nothing is dropped silently. Unreadable files are an error naming the file,
or skipped with one warning under ``data.args.skip_unreadable: true`` (:func:`drop_unreadable`).
Float files holding NaN or Inf are found as each file is decoded (:mod:`fastvision.data.nonfinite`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from fastvision.errors import ConfigError, DataError

log = logging.getLogger(__name__)
T = TypeVar("T")
POLICIES = ("warn", "error")


def first_few(ids: Sequence[Any], n: int = 3) -> str:
    """``[5, 7, 9, 11]`` -> ``"5, 7, 9, ..."``."""
    return ", ".join(str(i) for i in ids[:n]) + (", ..." if len(ids) > n else "")


def summarize(anomalies: dict[str, Sequence[Any]]) -> str:
    """``{"degenerate box": [5, 7]}`` -> ``"2 degenerate box (ids 5, 7)"``, kinds joined by "; "."""
    return "; ".join(f"{len(v)} {kind} ({first_few(v)})" for kind, v in anomalies.items() if v)


def handle_invalid(source: str | Path, anomalies: dict[str, Sequence[Any]], policy: str,
                   what: str = "invalid annotations skipped") -> int:
    """Warn about (or refuse) the anomalies found in ``source``; returns how many there were.

    Args:
        source: the file or folder they came from (named in the message).
        anomalies: kind -> ids (annotation ids, file names) of that kind.
        policy: ``"warn"`` (one warning) or ``"error"`` (DataError, exit 2).
        what: what happened to them, for the message.
    """
    if policy not in POLICIES:
        raise ConfigError(f"data.args.invalid must be one of {', '.join(POLICIES)}, got {policy!r}")
    total = sum(len(v) for v in anomalies.values())
    if total:
        msg = f"{source}: {total} {what}: {summarize(anomalies)}"
        if policy == "error":
            raise DataError(f"{msg} (data.args.invalid=error; set it to warn to skip them)")
        log.warning("%s", msg)
    return total


def drop_unreadable(items: list[T], files_of: Callable[[T], Iterable[str | Path | None]],
                    probe: Callable[[Path], Any], skip: bool, source: str | Path) -> list[T]:
    """Items whose files all pass ``probe`` (a cheap header read), when ``skip`` is set.

    Without ``skip`` nothing is probed here: a file that does not decode stops the run later with
    an error naming it (as every reader does). With ``skip``, one warning names the count and the
    first files dropped.
    """
    if not skip:
        return items
    keep, bad = [], []
    for item in items:
        for f in files_of(item):
            if f is None:
                continue
            try:
                probe(Path(f))
            except Exception:  # any decoder failure: the file is unusable
                bad.append(str(f))
                break
        else:
            keep.append(item)
    if bad:
        log.warning("%s: skipped %d unreadable file(s) (data.args.skip_unreadable): %s", source, len(bad),
                    first_few(bad))
    if not keep:
        raise DataError(f"{source}: no readable files left after skipping {len(bad)} unreadable ones")
    return keep


def nifti_header(path: Path) -> None:
    """Raise if ``path`` is not a NIfTI file whose header (and image size) can be read."""
    import nibabel as nib

    img = nib.load(str(path))
    if not all(int(n) > 0 for n in img.shape):
        raise ValueError(f"empty image {img.shape}")
    nifti_complete(Path(path), img)


def unreadable_files(cases: Sequence[dict[str, Any]], root: Path) -> list[str]:
    """``["HGG/x/x_t1.nii.gz: file ends early ...", ...]``: the cases' image and label files that
    :func:`nifti_header` refuses."""
    out = []
    for f in (f for c in cases for f in (*c["image"], c["label"]) if f is not None):
        try:
            nifti_header(Path(f))
        except Exception as e:  # noqa: BLE001  (any nibabel failure: the file is not a usable NIfTI)
            out.append(f"{Path(f).relative_to(root)}: {str(e).splitlines()[0][:120]}")
    return out


def nifti_complete(path: Path, img: Any) -> None:
    """Raise if the voxel data of the NIfTI file ``path`` (``img``, loaded) ends early, e.g. a truncated
    download: a ``.nii`` shorter than its header's data, a ``.nii.gz`` whose gzip trailer does not give the
    size the header implies and whose stream does not decompress to it. Reads the last bytes of the file
    (a full decompression only where the trailer disagrees, such as a multi-member gzip)."""
    import gzip
    import zlib

    if not path.name.lower().endswith((".nii", ".nii.gz")):
        return
    offset = getattr(img.dataobj, "offset", None) or int(img.header.get_data_offset())  # vox_offset 0: after the header
    want = int(offset) + int(np.prod(img.shape)) * img.get_data_dtype().itemsize
    if path.name.lower().endswith(".nii"):
        if path.stat().st_size < want:
            raise ValueError(f"file ends early: {path.stat().st_size} bytes, its header needs {want}")
        return
    with open(path, "rb") as f:
        f.seek(-4, 2)
        if int.from_bytes(f.read(4), "little") == want % 2**32:
            return
    try:
        with gzip.open(path, "rb") as g:
            got = sum(len(b) for b in iter(lambda: g.read(1 << 24), b""))
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"compressed data ends early or is damaged ({e})") from None
    if got < want:
        raise ValueError(f"file ends early: {got} bytes decompressed, its header needs {want}")


def image_channels(path: str | Path) -> int | None:
    """Channels of a NIfTI image from its header (a 4-D file's last axis; 3-D: 1); None where the
    header does not read (the full read then stops naming the file)."""
    import nibabel as nib

    try:
        shape = nib.load(str(path)).shape
    except Exception:  # noqa: BLE001  (any nibabel failure: reported by the reader that needs the data)
        return None
    return int(np.prod(shape[3:])) if len(shape) > 3 else 1


def channel_mismatches(cases: Sequence[dict[str, Any]], names: Sequence[str]) -> list[tuple[Path, int]]:
    """``[(image, channels)]``: training images whose channel count is not the number of modalities
    ``names`` (dataset.json's; nnU-Net's ``verify_dataset_integrity`` refuses them: a model would be
    built for the wrong number of input channels). Header reads only; no names, no check. The image named is
    the case's file, or of a case of one file per channel (nnU-Net v2's), its first file of more than one."""
    out = []
    for case in cases if names else []:
        counts = [image_channels(p) for p in case["image"]]
        if None not in counts and sum(counts) != len(names):
            many = [p for p, n in zip(case["image"], counts, strict=True) if n > 1] if len(counts) > 1 else []
            out.append((Path((many or case["image"])[0]), sum(counts)))
    return out


def check_channels(cases: Sequence[dict[str, Any]], names: Sequence[str], source: str | Path) -> None:
    """One line naming the first training image whose channels are not the modalities ``names`` of ``source``."""
    bad = channel_mismatches(cases, names)
    if bad:
        raise DataError(f"{bad[0][0]}: {bad[0][1]} channel(s) in its case, but {source} names {len(names)} "
                        f"modalit{'y' if len(names) == 1 else 'ies'} ({', '.join(names)})"
                        + (f"; {len(bad) - 1} more image(s) alike" if len(bad) > 1 else ""))


def case_grid_problems(cases: Sequence[dict[str, Any]], channels: int | None,
                       root: Path | None = None) -> list[str]:
    """One line per case whose image files (a BraTS case's modalities) are not one image, from the headers:
    a file not 3-D or 4-D, a file on another grid (shape or affine) than the case's first, or ``channels``
    other than the model's (a 4-D modality file of two volumes). Files are named relative to ``root`` when
    given. Cases whose headers do not read are left to the reader, which names the file."""
    import nibabel as nib

    from fastvision.data.preprocess3d import check_channel_file

    out = []
    for case in cases:
        first, counts = None, {}
        try:
            for path in case["image"]:
                img = nib.load(str(path))
                p = Path(path).relative_to(root) if root is not None else path
                check_channel_file(p, img.shape, img.affine, first)
                first = first or (p, img.shape, img.affine)
                counts[p] = int(np.prod(img.shape[3:])) if len(img.shape) > 3 else 1
        except DataError as e:
            out.append(str(e))
            continue
        except Exception:  # noqa: BLE001  (an unreadable header: drop_unreadable or the reader names it)
            continue
        if channels is not None and sum(counts.values()) != channels:
            many = next((p for p, n in counts.items() if n > 1), next(iter(counts)))
            out.append(f"{many}: {counts[many]} volume(s); case {case['id']} holds {sum(counts.values())} "
                       f"channels in its {len(counts)} files, not {channels}")
    return out


def image_header(path: Path) -> None:
    """Raise if Pillow cannot identify ``path`` (its header)."""
    from PIL import Image

    with Image.open(path) as im:
        im.size  # noqa: B018 - the header is parsed on open; touching size keeps linters honest



EXIF_ORIENTATION = 0x0112


class ImageFacts(NamedTuple):
    """What a data check reads of an image file: ``(width, height)``, Pillow's format and mode, and
    the EXIF orientation tag (1 when absent)."""
    size: tuple[int, int]
    format: str
    mode: str
    orientation: int | None


def image_facts(path: str | Path) -> ImageFacts | None:
    """The :class:`ImageFacts` of a file that decodes to its end (:func:`check_complete`), else None."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            facts = ImageFacts(im.size, str(im.format), im.mode, im.getexif().get(EXIF_ORIENTATION, 1))
            check_complete(im, Path(path))
    except Exception:  # noqa: BLE001  (any decoder failure, truncated data included)
        return None
    return facts


# What a complete file of these formats ends with (after optional trailing padding).
_END_MARKERS = {"JPEG": b"\xff\xd9", "PNG": b"IEND\xaeB`\x82"}


def check_complete(im: Any, path: Path) -> None:
    """Raise if the opened Pillow image ``im`` (of ``path``) does not decode to the end, e.g. a
    truncated download. JPEG and PNG files that end with their end marker are taken as complete
    (a read of the file's last bytes); others, and any file without the marker, are decoded in full."""
    marker = _END_MARKERS.get(im.format)
    if marker is not None:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 64))
            if f.read().rstrip(b"\x00\r\n ").endswith(marker):
                return
    im.load()  # raises OSError ("image file is truncated") on missing data


def undecodable(files: Iterable[str | Path]) -> list[str | Path]:
    """The ``files`` that :func:`image_decodes` refuses (any decoder failure), in their order."""
    bad = []
    for f in files:
        try:
            image_decodes(Path(f))
        except Exception:  # noqa: BLE001  (any decoder failure: the image is unusable)
            bad.append(f)
    return bad


def image_decodes(path: Path) -> None:
    """Raise if ``path`` is not an image that decodes to the end (header read, then
    :func:`check_complete`): the probe of ``data.args.skip_unreadable`` for COCO images."""
    from PIL import Image

    with Image.open(path) as im:
        check_complete(im, path)
