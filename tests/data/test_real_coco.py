"""COCO as users bring it: grey, EXIF-tagged and PNG images, empty images, crowd RLE, bad annotations.

The replica follows COCO 2017 (12-digit file names, instances_<split>.json with info/licenses,
uncompressed RLE for crowd regions) with 32 px images; what the reader returns is checked
against the boxes written, and every defect is reported (warning or one-line error).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as mask_utils

from fastvision.cli import main
from fastvision.data.formats.coco import build
from fastvision.data.inspect import inspect_path
from fastvision.errors import DataError

CATS = [{"supercategory": "person", "id": 1, "name": "person"},
        {"supercategory": "vehicle", "id": 3, "name": "car"}]


pytestmark = pytest.mark.usefixtures("fresh_logging")


def _rle(mask: np.ndarray) -> dict:
    """COCO's uncompressed RLE (column-major run lengths, starting with a run of zeros)."""
    flat = mask.T.reshape(-1).astype(np.uint8)
    counts, prev, run = [], 0, 0
    for v in flat:
        if v != prev:
            counts.append(run)
            prev, run = v, 0
        run += 1
    counts.append(run)
    return {"counts": counts, "size": list(mask.shape)}


def _jpeg(path: Path, arr: np.ndarray, **kw) -> None:
    Image.fromarray(arr).save(path, quality=95, **kw)


def make_coco(root: Path) -> Path:
    """val2017 with every quirk; train2017 with two plain images."""
    for split in ("train2017", "val2017"):
        (root / split).mkdir(parents=True)
    (root / "annotations").mkdir()
    rgb = np.full((32, 32, 3), 40, np.uint8)
    rgb[4:20, 8:24] = 220  # the object of annotation 1: x 8..24, y 4..20
    _jpeg(root / "val2017/000000000139.jpg", rgb)
    grey = np.full((32, 32), 30, np.uint8)
    grey[10:30, 2:12] = 200
    _jpeg(root / "val2017/000000000285.jpg", grey)  # mode L, as ~1 % of COCO
    wide = np.full((16, 32, 3), 20, np.uint8)  # stored 32 x 16, tagged "rotate 90" (EXIF orientation 6)
    wide[2:10, 20:30] = 230
    exif = Image.Exif()
    exif[0x0112] = 6
    _jpeg(root / "val2017/000000000632.jpg", wide, exif=exif.tobytes())
    Image.fromarray(rgb).save(root / "val2017/000000000724.png")  # a PNG image
    _jpeg(root / "val2017/000000000776.jpg", rgb)  # no annotations at all
    crowd = np.zeros((32, 32), np.uint8)
    crowd[16:28, 4:30] = 1
    images = [{"license": 1, "file_name": n, "coco_url": "", "height": h, "width": w, "date_captured": "", "id": i}
              for n, h, w, i in (("000000000139.jpg", 32, 32, 139), ("000000000285.jpg", 32, 32, 285),
                                 ("000000000632.jpg", 16, 32, 632), ("000000000724.png", 32, 32, 724),
                                 ("000000000776.jpg", 32, 32, 776))]
    anns = [
        {"id": 1, "image_id": 139, "category_id": 1, "bbox": [8.0, 4.0, 16.0, 16.0], "area": 256.0, "iscrowd": 0,
         "segmentation": [[8, 4, 24, 4, 24, 20, 8, 20]]},
        {"id": 2, "image_id": 285, "category_id": 3, "bbox": [2.0, 10.0, 10.0, 20.0], "area": 200.0, "iscrowd": 0,
         "segmentation": [[2, 10, 12, 10, 12, 30, 2, 30]]},
        {"id": 3, "image_id": 632, "category_id": 1, "bbox": [20.0, 2.0, 10.0, 8.0], "area": 80.0, "iscrowd": 0,
         "segmentation": [[20, 2, 30, 2, 30, 10, 20, 10]]},
        {"id": 4, "image_id": 724, "category_id": 3, "bbox": [8.0, 4.0, 16.0, 16.0], "area": 256.0, "iscrowd": 0,
         "segmentation": [[8, 4, 24, 4, 24, 20, 8, 20]]},
        {"id": 5, "image_id": 139, "category_id": 1, "bbox": [4.0, 16.0, 26.0, 12.0], "area": 312.0, "iscrowd": 1,
         "segmentation": _rle(crowd)},
        {"id": 6, "image_id": 139, "category_id": 1, "bbox": [5.0, 5.0, 0.0, 7.0], "area": 0.0, "iscrowd": 0,
         "segmentation": [[]]},  # zero width
        {"id": 7, "image_id": 285, "category_id": 3, "bbox": [9.0, 9.0, 4.0, -3.0], "area": 0.0, "iscrowd": 0,
         "segmentation": [[]]},  # negative height
        {"id": 8, "image_id": 999, "category_id": 1, "bbox": [1.0, 1.0, 5.0, 5.0], "area": 25.0, "iscrowd": 0,
         "segmentation": [[]]},  # unknown image
        {"id": 9, "image_id": 724, "category_id": 77, "bbox": [1.0, 1.0, 5.0, 5.0], "area": 25.0, "iscrowd": 0,
         "segmentation": [[]]},  # unknown category
    ]
    info = {"description": "COCO 2017 Dataset", "url": "http://cocodataset.org", "version": "1.0", "year": 2017,
            "contributor": "COCO Consortium", "date_created": "2017/09/01"}
    licenses = [{"url": "http://creativecommons.org/licenses/by-nc-sa/2.0/", "id": 1, "name": "Attribution"}]
    (root / "annotations/instances_val2017.json").write_text(json.dumps(
        {"info": info, "licenses": licenses, "images": images, "annotations": anns, "categories": CATS}))
    _jpeg(root / "train2017/000000000009.jpg", rgb)
    _jpeg(root / "train2017/000000000025.jpg", rgb)
    (root / "annotations/instances_train2017.json").write_text(json.dumps(
        {"info": info, "licenses": licenses, "images": [
            {"file_name": "000000000009.jpg", "height": 32, "width": 32, "id": 9},
            {"file_name": "000000000025.jpg", "height": 32, "width": 32, "id": 25}],
         "annotations": [{"id": 100, "image_id": 9, "category_id": 3, "bbox": [8.0, 4.0, 16.0, 16.0],
                          "area": 256.0, "iscrowd": 0, "segmentation": [[8, 4, 24, 4, 24, 20, 8, 20]]}],
         "categories": CATS}))
    return root


@pytest.fixture
def coco_root(tmp_path):
    return make_coco(tmp_path / "coco")


def test_replica_rle_is_what_pycocotools_reads(coco_root):
    ann = json.loads((coco_root / "annotations/instances_val2017.json").read_text())["annotations"][4]
    m = mask_utils.decode(mask_utils.frPyObjects(ann["segmentation"], 32, 32))
    assert m.sum() == 12 * 26 and m[16:28, 4:30].all()


def test_quirky_val_split_loads_and_reports(coco_root, caplog):
    with caplog.at_level(logging.WARNING):
        splits = build(path=str(coco_root), image_size=32)
    val = splits.val
    assert splits.info["val_images"] == 5 and splits.info["cat_ids"] == [1, 3]
    items = {val[i]["image_id"]: val[i] for i in range(len(val))}
    a = items[139]  # RGB: one box and the crowd RLE region, both kept
    assert a["image"].shape == (3, 32, 32) and a["image"].dtype == torch.uint8
    assert a["boxes"].tolist() == [[8, 4, 24, 20], [4, 16, 30, 28]]
    assert a["labels"].tolist() == [0, 0] and a["iscrowd"].tolist() == [False, True]
    g = items[285]  # grey JPEG -> three equal channels; the negative-height box is gone
    assert torch.equal(g["image"][0], g["image"][1]) and g["boxes"].tolist() == [[2, 10, 12, 30]]
    assert g["labels"].tolist() == [1]
    r = items[632]  # EXIF orientation not applied: stored 32 x 16, resized to 32 x 32 -> y doubles
    assert r["orig_size"] == (16, 32) and r["boxes"].tolist() == [[20, 4, 30, 20]]
    x0, y0, x1, y1 = (int(v) for v in r["boxes"][0])
    assert r["image"][:, y0:y1, x0:x1].float().mean() > 3 * r["image"].float().mean() / 2
    assert items[724]["boxes"].tolist() == [[8, 4, 24, 20]]  # PNG; the unknown-category annotation skipped
    assert items[776]["boxes"].shape == (0, 4)  # images without annotations are kept
    warnings = [r.getMessage() for r in caplog.records if "invalid annotations" in r.getMessage()]
    assert len(warnings) == 1
    w = warnings[0]
    assert "instances_val2017.json: 4 invalid annotations skipped" in w
    assert "2 degenerate box (width or height <= 0) (6, 7)" in w and "unknown image_id (8)" in w
    assert "unknown category_id (9)" in w


def test_invalid_error_and_missing_image_are_one_line(coco_root, tmp_path, capsys):
    with pytest.raises(DataError, match=r"instances_val2017.json: 4 invalid annotations.*invalid=error"):
        build(path=str(coco_root), image_size=32, invalid="error")
    (coco_root / "val2017/000000000776.jpg").unlink()
    with pytest.raises(DataError, match=r"000000000776.jpg: image listed in instances_val2017.json not found"):
        build(path=str(coco_root), image_size=32)
    (coco_root / "val2017/000000000285.jpg").write_bytes(b"not a jpeg")
    splits = build(path=str(coco_root), image_size=32, skip_unreadable=True)
    assert sorted(splits.val.ids) == [139, 632, 724]
    # the CLI: a training run with data.args.invalid=error stops before training, one line, exit 2
    rc = main(["train", "ssd320-small-shapes", "--data", str(coco_root), "--out", str(tmp_path / "run"),
               "--set", "data.args.invalid=error", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "instances_" in err[0] and "invalid annotations" in err[0]


def test_inspect_counts_valid_boxes_and_lists_anomalies(coco_root, capsys):
    report = inspect_path(coco_root)
    assert report["val2017 images (without boxes)"] == "5 (1)"  # not "(-1)": unknown image ids do not count
    assert report["val2017 boxes (crowd)"] == "5 (1)"
    assert report["val2017 image formats (headers of 5)"] == {"JPEG": 4, "PNG": 1}
    assert report["val2017 image modes"] == {"RGB": 4, "L": 1}
    an = report["anomalies"]
    assert an["val2017: annotations with degenerate box (width or height <= 0) (skipped; ids)"] == "2 (6, 7)"
    assert an["val2017: annotations with unknown image_id (skipped; ids)"] == "1 (8)"
    assert an["val2017: EXIF orientation tag (not applied: boxes refer to stored pixels)"] == "1 (000000000632.jpg)"
    assert main(["data", "inspect", str(coco_root)]) == 0
    out = capsys.readouterr().out
    assert "unknown category_id" in out and "(-1)" not in out


def _replica_warning(line: str) -> bool:
    """The warnings every build of the replica logs: its val file's invalid annotations, and its training
    file's category without a box (person: its one training box is a car)."""
    return "invalid annotations skipped" in line or "without a box" in line


def _edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _own_boxes_score_1(coco_root):
    """COCOeval of the val set's own boxes (as the reader gives them) as detections: a perfect 1."""
    from fastvision.data.formats.coco import collate_detection
    from fastvision.metrics.coco import COCOEvaluator, ground_truth_as_detections

    splits = build(path=str(coco_root), image_size=32)
    ev = COCOEvaluator(splits.info["val_ann_file"], splits.info["cat_ids"], (32, 32))
    batch = collate_detection([splits.val[i] for i in range(len(splits.val))])
    ev.update(ground_truth_as_detections(batch), batch)
    metrics = ev.compute()
    assert metrics["map"] == pytest.approx(1.0) and metrics["ap50"] == pytest.approx(1.0)


def test_skipped_annotations_are_not_ground_truth_of_the_evaluation(coco_root):
    """The val file's degenerate / unknown-image / unknown-category annotations are skipped by the reader
    and by COCOeval's ground truth alike: the reader's own boxes as detections score 1 (they scored
    0.75-0.9 when the skipped boxes still counted as missed ground truth)."""
    _own_boxes_score_1(coco_root)


def test_duplicate_annotation_id_is_reported_and_does_not_replace_the_first(coco_root, caplog):
    """A merged export reusing an annotation id: pycocotools' index keeps the last one under that id, which
    gave image 9 the box of image 25; the reader keeps the first, skips and reports the second."""
    ann = coco_root / "annotations/instances_train2017.json"
    _edit(ann, lambda d: d["annotations"].append(
        {"id": 100, "image_id": 25, "category_id": 1, "bbox": [1.0, 2.0, 5.0, 6.0], "area": 30.0, "iscrowd": 0}))
    with caplog.at_level(logging.WARNING):
        train = build(path=str(coco_root), image_size=32).train
    items = {train[i]["image_id"]: train[i] for i in range(len(train))}
    assert items[9]["boxes"].tolist() == [[8, 4, 24, 20]] and items[9]["labels"].tolist() == [1]
    assert items[25]["boxes"].shape == (0, 4)
    w = [r.getMessage() for r in caplog.records if "instances_train2017.json" in r.getMessage()
         and "without a box" not in r.getMessage()]
    assert len(w) == 1 and "1 annotation id used before in the file (100)" in w[0]
    with pytest.raises(DataError, match=r"instances_train2017.json: 1 invalid annotations"):
        build(path=str(coco_root), image_size=32, invalid="error")
    report = inspect_path(coco_root)
    assert report["anomalies"]["train2017: annotations with annotation id used before in the file (skipped; ids)"] \
        == "1 (100)"


def test_truncated_jpeg_is_reported_by_inspect_and_skipped_on_request(coco_root, caplog):
    """A download cut short keeps a readable header: inspect listed no anomaly and skip_unreadable kept the
    image, so the run stopped on it mid-epoch. Both now read the file to its end."""
    f = coco_root / "train2017/000000000025.jpg"
    _jpeg(f, np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))  # mostly pixel data
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 3 // 4])
    with Image.open(f) as im:  # the header still reads: only the pixels are cut
        assert im.size == (32, 32)
    an = inspect_path(coco_root)["anomalies"]
    assert [v for k, v in an.items() if k.startswith("train2017: unreadable image file")] == ["1 (000000000025.jpg)"]
    with caplog.at_level(logging.WARNING):
        splits = build(path=str(coco_root), image_size=32, skip_unreadable=True)
    assert splits.train.ids == [9]
    assert any("skipped 1 unreadable" in r.getMessage() and "000000000025.jpg" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(DataError, match=r"000000000025.jpg.*truncated"):
        build(path=str(coco_root), image_size=32).train.decode(1)


@pytest.mark.parametrize("defect, where", [
    (lambda d: d["images"][0].pop("file_name"), "images[0] (id 9) has no file_name"),
    (lambda d: d["images"].append(dict(d["images"][0])), "images[2]: image id 9 listed twice"),
    (lambda d: d["images"][1].update(id="25"), "images[1] has no integer id"),
    (lambda d: d.pop("categories"), "no 'categories' list"),
    # scored 0 silently: the results' category_id is an int, the ground truth's the string "1"
    (lambda d: [c.update(id=str(c["id"])) for c in d["categories"]], "categories[0] ('person'): id '1' is not"),
    # pycocotools' getCatIds listed id 3 twice: 3 classes for 2 categories, one of them never trained
    (lambda d: d["categories"].append(dict(d["categories"][1])), "categories[2] ('car'): category id 3 listed"),
    # a traceback from torch.tensor(image ids) in the first batch's collate (int64 overflow)
    (lambda d: [x.update(**{k: x[k] + 2**63}) for k, xs in (("id", d["images"]), ("image_id", d["annotations"]))
                for x in xs], "images[0]: image id 9223372036854775817 does not fit a 64-bit integer"),
    # two ids for one picture, each with part of its boxes: validation scored each against the same detections
    (lambda d: d["images"].append({**d["images"][0], "id": 77}), "images[2] (id 77): file_name 000000000009.jpg "
                                                                  "listed before, as image id 9"),
], ids=["no-file-name", "image-id-twice", "string-image-id", "no-categories", "string-category-id",
        "category-id-twice", "image-id-past-int64", "file-name-twice"])
def test_malformed_instances_file_is_one_line_in_train_and_inspect(coco_root, tmp_path, capsys, defect, where):
    """A file that is not COCO in its structure: one line naming the file and the first bad entry, exit 2,
    from train and from data inspect (an image without file_name was a KeyError traceback in both)."""
    _edit(coco_root / "annotations/instances_train2017.json", defect)
    for argv in (["data", "inspect", str(coco_root)],
                 ["train", "ssd320-small-shapes", "--data", str(coco_root), "--out", str(tmp_path / "run"),
                  "--device", "cpu"]):
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, (argv[0], err)
        assert "instances_train2017.json: not a COCO instances file" in err[0] and where in err[0]
    assert not (tmp_path / "run").exists()


def test_annotation_without_id_is_an_anomaly_not_a_traceback(coco_root, capsys):
    _edit(coco_root / "annotations/instances_val2017.json", lambda d: d["annotations"][0].pop("id"))
    assert main(["data", "inspect", str(coco_root)]) == 0
    assert "annotation without an id" in capsys.readouterr().out
    with pytest.raises(DataError, match=r"1 annotation without an id \(integer or string\) \(image 139\)"):
        build(path=str(coco_root), image_size=32, invalid="error")


def test_inspect_exits_2_on_what_training_stops_on(coco_root, capsys):
    """Listed images missing on disk, an image that does not decode, a validation category the training
    file lacks: the reader stops on each (without skip_unreadable), so inspect lists them and exits 2
    (it listed them as anomalies and exited 0, as for the annotations the reader only skips)."""
    (coco_root / "val2017/000000000776.jpg").unlink()
    (coco_root / "val2017/000000000724.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    _edit(coco_root / "annotations/instances_val2017.json",
          lambda d: d["categories"].append({"supercategory": "animal", "id": 42, "name": "dog"}))
    report = inspect_path(coco_root)
    assert report["unusable"] == {"val2017: listed images missing on disk": 1,
                                  "val2017: " + "unreadable image file (header or pixels do not decode, e.g. a "
                                  "truncated download)": 1,
                                  "val2017: category ids not in train2017's categories": 1}
    assert report["anomalies"]["val2017: listed images missing on disk"] == "1 (000000000776.jpg)"
    assert report["anomalies"]["val2017: category ids not in train2017's categories"] == "1 (42)"
    assert main(["data", "inspect", str(coco_root)]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and "3 file(s) would stop training" in err[0] and "000000000776.jpg" in cap.out
    with pytest.raises(DataError, match=r"instances_val2017.json: category ids \[42\] are not in the training"):
        build(path=str(coco_root), image_size=32)  # what inspect predicted


def test_16_bit_grey_png_is_scaled_not_clipped(coco_root):
    """A 16-bit grey PNG (thermal, microscopy exports): Pillow's convert("RGB") clipped every value over 255,
    so the image read almost white; it is scaled to 8 bits as the ImageFolder reader does."""
    arr = np.full((32, 32), 1000, np.uint16)
    arr[4:20, 8:24] = 20000  # annotation 4's box
    Image.fromarray(arr).save(coco_root / "val2017/000000000724.png")
    with Image.open(coco_root / "val2017/000000000724.png") as im:
        assert im.mode.startswith("I")  # really 16-bit on disk
    val = build(path=str(coco_root), image_size=32).val
    item = next(val[i] for i in range(len(val)) if val[i]["image_id"] == 724)
    img = item["image"]
    assert torch.equal(img[0], img[1]) and torch.equal(img[1], img[2])
    assert int(img[0, 10, 15]) == round(20000 * 255 / 65535) and int(img[0, 28, 2]) == round(1000 * 255 / 65535)


def test_data_shard_checks_coco_images_before_writing(coco_root, tmp_path, caplog, capsys):
    """A truncated JPEG was packed into the shards silently and training from them stopped on it mid-epoch;
    it is one line before anything is written, or left out with --skip-unreadable."""
    from fastvision.data.shards.writer import write_shards

    f = coco_root / "train2017/000000000025.jpg"
    _jpeg(f, np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 3 // 4])
    with caplog.at_level(logging.WARNING):
        index = write_shards(coco_root, tmp_path / "skipped", skip_unreadable=True)
    assert sum(s.nsamples for s in index.splits["train"]) == 1 and sum(s.nsamples for s in index.splits["val"]) == 5
    assert any("skipped 1 unreadable" in r.getMessage() for r in caplog.records)
    out = tmp_path / "shards"
    assert main(["data", "shard", str(coco_root), str(out)]) == 2
    err = [e for e in capsys.readouterr().err.strip().splitlines() if not _replica_warning(e)]
    assert len(err) == 1 and "1 image file(s) that do not decode (train2017/000000000025.jpg)" in err[0]  # the
    assert not out.exists()  # replica's val file also warns about its invalid annotations, as in training


def test_annotations_without_area_or_iscrowd_are_evaluated(coco_root):
    """Exports that leave out area and iscrowd (both optional to the reader) stopped the first validation with
    COCOeval's KeyError traceback, after a whole epoch; area is the box's (as pycocotools gives detections)."""
    from fastvision.data.formats.coco import collate_detection, load_coco
    from fastvision.metrics.coco import COCOEvaluator, ground_truth_as_detections

    def strip(d):
        for a in d["annotations"]:
            if not a.get("iscrowd"):
                a.pop("iscrowd")
                a.pop("area")
        d["annotations"][0]["area"] = "256"  # not a number either
    _edit(coco_root / "annotations/instances_val2017.json", strip)
    splits = build(path=str(coco_root), image_size=32)
    gt = load_coco(splits.info["val_ann_file"])
    assert gt.anns[1]["area"] == 256.0 and gt.anns[1]["iscrowd"] == 0 and gt.anns[2]["area"] == 200.0
    ev = COCOEvaluator(splits.info["val_ann_file"], splits.info["cat_ids"], (32, 32))
    batch = collate_detection([splits.val[i] for i in range(len(splits.val))])
    ev.update(ground_truth_as_detections(batch), batch)
    assert ev.compute()["map"] == pytest.approx(1.0)


def test_truncated_validation_image_stops_before_training(coco_root, tmp_path, capsys):
    """A validation image cut short stopped the run at the first validation, a whole epoch later (no
    checkpoint yet); the validation split's images are decoded to their end when the dataset is built."""
    f = coco_root / "val2017/000000000139.jpg"
    _jpeg(f, np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 3 // 4])
    rc = main(["train", "ssd320-small-shapes", "--data", str(coco_root), "--out", str(tmp_path / "run"),
               "--device", "cpu", "--epochs", "1", "--batch-size", "1", "--set", "examples=0"])
    err = [e for e in capsys.readouterr().err.strip().splitlines() if not _replica_warning(e)]
    assert rc == 2 and len(err) == 1, err
    assert "000000000139.jpg: image listed in instances_val2017.json does not decode" in err[0]
    assert not (tmp_path / "run").exists()
    assert 139 not in build(path=str(coco_root), image_size=32, skip_unreadable=True).val.ids


@pytest.mark.parametrize("split, edit, line", [
    ("val2017", lambda d: d.update(images=[], annotations=[]), "instances_val2017.json: lists no images"),
    ("train2017", lambda d: d.update(annotations=[]), "instances_train2017.json: no usable box to train on in its 2"),
    ("train2017", lambda d: d["annotations"][0].update(bbox=[1, 1, 0, 5]),
     "no usable box to train on in its 2 images (1 invalid annotations skipped)"),
], ids=["val-without-images", "train-without-annotations", "train-only-invalid-boxes"])
def test_a_split_with_nothing_to_use_is_one_line_before_training(coco_root, tmp_path, capsys, split, edit, line):
    """A val file listing no images trained an epoch, then stopped on a StopIteration traceback; a training
    file without a usable box trained to mAP 0 without a word."""
    _edit(coco_root / f"annotations/instances_{split}.json", edit)
    rc = main(["train", "ssd320-small-shapes", "--data", str(coco_root), "--out", str(tmp_path / "run"),
               "--device", "cpu", "--epochs", "1", "--batch-size", "1", "--set", "examples=0"])
    err = [e for e in capsys.readouterr().err.strip().splitlines() if "invalid annotations skipped:" not in e]
    assert rc == 2 and len(err) == 1 and line in err[0], err
    assert not (tmp_path / "run").exists()
    assert inspect_path(coco_root)["unusable"]  # and data inspect exits 2 on it, as training stops


def test_every_listed_image_missing_is_not_called_unreadable(coco_root):
    """All of a split's images absent (the wrong folder) under skip_unreadable said 'no readable files left
    after skipping 0 unreadable ones'; it names the folder and the first file it looked for."""
    for f in (coco_root / "val2017").iterdir():
        f.unlink()
    with pytest.raises(DataError, match=r"val2017: none of the 5 images listed in instances_val2017.json is there "
                                        r"\(first: 000000000139.jpg\)"):
        build(path=str(coco_root), image_size=32, skip_unreadable=True)


def test_a_category_id_named_otherwise_in_val_or_in_evaluate_data_is_one_line(coco_root, tmp_path, capsys):
    """An export numbering categories per file: val's id 1 is 'car', train's 'person'. The model's class for
    id 1 was scored against the other category without a word (by id, COCOeval never sees the names); the
    reader and data inspect refuse it, and evaluate --data compares the classes (by name) with the run's."""
    from fastvision.api import check_same_classes

    trained = build(path=str(coco_root), image_size=32).info
    assert trained["classes"] == ["person", "car"]
    swap = lambda d: [c.update(name=n) for c, n in zip(d["categories"], ("car", "person"), strict=True)]  # noqa: E731
    _edit(coco_root / "annotations/instances_val2017.json", swap)
    with pytest.raises(DataError, match=r"instances_val2017.json: category id 1 is 'car' there, 'person' in "
                                        r"instances_train2017.json \(2 id\(s\) named otherwise"):
        build(path=str(coco_root), image_size=32)
    assert main(["data", "inspect", str(coco_root)]) == 2
    assert inspect_path(coco_root)["anomalies"]["val2017: category ids named otherwise in train2017"] \
        == "2 (1: 'car' ('person' in train2017), 3: 'person' ('car' in train2017))"
    _edit(coco_root / "annotations/instances_train2017.json", swap)  # both files: another folder, consistent
    given = build(path=str(coco_root), image_size=32).info
    with pytest.raises(DataError, match=r"class 0 is 'car' there, 'person' in training"):
        check_same_classes(trained, given, str(coco_root), "best.pt")
    check_same_classes(given, given, str(coco_root), "best.pt")  # the same names pass
    older = {k: v for k, v in trained.items() if k != "classes"}  # a checkpoint's info before it had classes
    with pytest.raises(DataError, match=r"class 0 is 'car' there, 'person' in training"):
        check_same_classes(older, given, str(coco_root), "best.pt")


def test_iscrowd_null_is_0_and_a_string_iscrowd_is_an_anomaly(coco_root, caplog):
    """iscrowd null (a labelling tool's 'not set') stopped COCOeval with int(None)'s TypeError traceback; "0"
    (a string) is true, so every such box was a crowd region the matcher and COCOeval ignore (a training file
    of them had 'no usable box'): null reads as 0, a value other than 0 or 1 is skipped and reported."""
    from fastvision.data.formats.coco import collate_detection
    from fastvision.metrics.coco import COCOEvaluator, ground_truth_as_detections

    def edit(d):
        for a in d["annotations"]:
            a["iscrowd"] = None if a["id"] in (1, 2) else a["iscrowd"]
        d["annotations"][3]["iscrowd"] = "0"  # id 4, image 724
    _edit(coco_root / "annotations/instances_val2017.json", edit)
    with caplog.at_level(logging.WARNING):
        splits = build(path=str(coco_root), image_size=32)
    assert any("1 iscrowd not 0 or 1 (4)" in r.getMessage() for r in caplog.records)
    items = {splits.val[i]["image_id"]: splits.val[i] for i in range(len(splits.val))}
    assert items[139]["iscrowd"].tolist() == [False, True] and items[724]["labels"].tolist() == []
    ev = COCOEvaluator(splits.info["val_ann_file"], splits.info["cat_ids"], (32, 32))
    batch = collate_detection(list(items.values()))
    ev.update(ground_truth_as_detections(batch), batch)
    assert ev.compute()["map"] == pytest.approx(1.0)


@pytest.mark.parametrize("name, listed, stored, hint", [
    ("000000000724.png", (32, 32), (16, 16), "a resized copy"),
    ("000000000632.jpg", (32, 16), (16, 32), "the transposed size")], ids=["resized", "exif-turned"])
def test_an_image_stored_at_another_size_than_listed_is_one_line(coco_root, capsys, name, listed, stored, hint):
    """Boxes are in the grid of the file's width/height: a val image resized since (or stored turned, its boxes
    drawn on the picture as EXIF shows it) was scored against boxes of another grid, and a training image
    taught them, without a word (data inspect listed it as an anomaly and exited 0). As detectron2, the
    reader stops: a validation image when the dataset is built, a training image when it is read."""
    w, h = stored
    Image.fromarray(np.full((h, w, 3), 90, np.uint8)).save(coco_root / "val2017" / name)
    with pytest.raises(DataError, match=rf"{name}: stored {w}x{h}, but instances_val2017.json lists it "
                                        rf"as {listed[0]}x{listed[1]}, the grid of its boxes \({hint}"):
        build(path=str(coco_root), image_size=32)
    report = inspect_path(coco_root)
    assert report["anomalies"]["val2017: " + "stored size differs from width/height in the file (the grid of its "
                               "boxes)"] == f"1 ({name})"
    assert main(["data", "inspect", str(coco_root)]) == 2
    capsys.readouterr()
    (coco_root / "val2017" / name).unlink()
    _edit(coco_root / "annotations/instances_val2017.json",
          lambda d: d.update(images=[im for im in d["images"] if im["file_name"] != name]))
    _jpeg(coco_root / "train2017/000000000025.jpg", np.full((h, w, 3), 90, np.uint8))
    train = build(path=str(coco_root), image_size=32).train
    with pytest.raises(DataError, match=rf"000000000025.jpg: stored {w}x{h}, but instances_train2017.json"):
        train.decode(1)
    assert train.decode(0)["orig_size"] == (32, 32)
    out = coco_root.parent / "shards"  # data shard reads every image: stops before a shard is written
    assert main(["data", "shard", str(coco_root), str(out)]) == 2
    err = [e for e in capsys.readouterr().err.strip().splitlines() if not _replica_warning(e)]
    assert len(err) == 1 and f"000000000025.jpg: stored {w}x{h}" in err[0] and not out.exists()


@pytest.mark.parametrize("renumber", [lambda i: i - 1, lambda i: f"ann-{i}"], ids=["from-0", "strings"])
def test_annotation_ids_from_0_or_strings_are_scored_as_coco_scores_them(coco_root, renumber):
    """COCOeval keeps the matched ground truth's id in a float array where 0 means unmatched: with an export's
    ids starting at 0, the detection of annotation 0 was a false positive (the reader's own boxes scored
    below 1), and string ids (which the reader takes) stopped the first validation with a ValueError."""
    _edit(coco_root / "annotations/instances_val2017.json",
          lambda d: [a.update(id=renumber(a["id"])) for a in d["annotations"]])
    _own_boxes_score_1(coco_root)


def test_training_boxes_reaching_past_the_image_are_clipped_without_the_crop():
    """COCO boxes may reach past the image (the synth set's do): the SSD crop clipped them to its window, but
    with data.args.crop=false they went to the matcher and the box coder as they were (torchvision's reference
    clamps them too); a box wholly outside, in a file without width/height, taught a box off the picture."""
    from fastvision.data.formats.coco import SSDAugment

    item = {"image": torch.zeros(3, 20, 40, dtype=torch.uint8), "orig_size": (20, 40),
            "boxes": torch.tensor([[-5.0, 2.0, 10.0, 25.0], [45.0, 0.0, 60.0, 10.0]]),
            "labels": torch.tensor([1, 0]), "iscrowd": torch.tensor([False, False])}
    out = SSDAugment(20, crop=False, flip=False)(item, torch.Generator().manual_seed(0))
    assert out["boxes"].tolist() == [[0.0, 2.0, 5.0, 20.0]] and out["labels"].tolist() == [1]  # x / 2, y / 1


def test_data_given_inside_the_coco_folder_or_another_split_name_says_what_to_pass(coco_root, tmp_path):
    """--data val2017/ or annotations/ said 'annotation file not found: val2017/annotations/instances_train2017.json',
    an annotation file suggested annotations/ as the folder, and an export with instances_train.json named no
    split option; each line now names the folder to pass or the split names the files give."""
    cases = [(coco_root / "val2017", rf"--data takes {coco_root}, which holds annotations/"),
             (coco_root / "annotations", rf"--data takes {coco_root}, which holds annotations/"),
             (coco_root / "annotations/instances_val2017.json", rf"the COCO dataset folder \({coco_root}, which")]
    for given, hint in cases:
        with pytest.raises(DataError, match=hint):
            build(path=str(given), image_size=32)
    for split in ("train2017", "val2017"):
        f = coco_root / f"annotations/instances_{split}.json"
        f.rename(f.with_name(f"instances_{split[:-4]}.json"))
    with pytest.raises(DataError, match=r"instances_train2017.json \(annotations/ holds instances_train.json, "
                                        r"instances_val.json: --set data.args.train_split=.*e.g. train, val\)"):
        build(path=str(coco_root), image_size=32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"a COCO folder holds annotations/instances_<split>.json"):
        build(path=str(tmp_path / "empty"), image_size=32)


def test_a_training_category_without_a_box_is_one_warning_and_an_inspect_anomaly(coco_root, caplog):
    """A Roboflow-style export's placeholder category 0 ('objects', no annotation), or a class filtered out:
    the model got a class for it that no box trains, without a word (only the class count showed it)."""
    _edit(coco_root / "annotations/instances_train2017.json",
          lambda d: d["categories"].insert(0, {"supercategory": "none", "id": 0, "name": "objects"}))
    with caplog.at_level(logging.WARNING):
        splits = build(path=str(coco_root), image_size=32)
    assert splits.info["num_classes"] == 3
    warned = [r.getMessage() for r in caplog.records if "without a box" in r.getMessage()]
    assert len(warned) == 1 and "2 categories without a box (0 'objects', 1 'person')" in warned[0]  # train has
    assert inspect_path(coco_root)["anomalies"][  # one box, a car: person is never trained either
        "train2017: categories without a box (classes never trained)"] == "2 (0 'objects', 1 'person')"


def test_an_area_of_0_or_below_is_the_box_area():
    """An export writing area 0 (no segmentation measured) put every box in COCOeval's 'small' range (AP medium
    and large read -1 or scored the wrong boxes), and a negative area left the box out of every range."""
    from fastvision.data.formats.coco_check import check_annotations

    data = {"images": [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 100}],
            "categories": [{"id": 1, "name": "x"}],
            "annotations": [{"id": k, "image_id": 1, "category_id": 1, "bbox": [0, 0, 40, 50], "area": area,
                             "iscrowd": 0} for k, area in ((1, 0), (2, -3.0), (3, 1234.5))]}
    usable, bad = check_annotations(data)
    assert not bad and [a["area"] for a in usable] == [2000.0, 2000.0, 1234.5]  # a positive area is kept
