"""ImageNet as distributed: CMYK and PNG-named-.JPEG training files, a flat val folder labelled by
the Kaggle LOC_val_solution.csv or the devkit's ground truth + meta.mat, used without preparation."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastvision.cli import main
from fastvision.data.formats.imagefolder import open_image
from fastvision.data.inspect import inspect_path
from fastvision.errors import DataError
from fastvision.registry import DATASETS

WNIDS = ["n01440764", "n01443537", "n02105855"]  # tench, goldfish, Shetland sheepdog
COLOURS = {"n01440764": (200, 40, 40), "n01443537": (40, 200, 40), "n02105855": (40, 40, 200)}
VAL = [("ILSVRC2012_val_00000001.JPEG", "n02105855"), ("ILSVRC2012_val_00000002.JPEG", "n01440764"),
       ("ILSVRC2012_val_00000003.JPEG", "n01443537"), ("ILSVRC2012_val_00000004.JPEG", "n01440764")]
ILSVRC_ID = {"n01440764": 449, "n01443537": 450, "n02105855": 235}  # the devkit's ids are not wnid order


pytestmark = pytest.mark.usefixtures("fresh_logging")


def _photo(colour) -> Image.Image:
    arr = np.empty((32, 40, 3), np.uint8)
    arr[:] = colour
    arr[8:24, 10:30] = 255 - np.array(colour, np.uint8)
    return Image.fromarray(arr)


def make_imagenet(root: Path, val_flat: bool = True) -> Path:
    """train/<wnid>/<wnid>_<n>.JPEG with one CMYK JPEG and one PNG named .JPEG, val/ flat."""
    for w in WNIDS:
        d = root / "train" / w
        d.mkdir(parents=True)
        for n in (10026, 10027):
            _photo(COLOURS[w]).save(d / f"{w}_{n}.JPEG", quality=95)
        (d / f"._{w}_10026.JPEG").write_bytes(b"\x00\x05\x16\x07" + bytes(60))  # macOS companion
    _photo(COLOURS["n01440764"]).convert("CMYK").save(root / "train/n01440764/n01440764_18.JPEG", quality=95)
    _photo(COLOURS["n02105855"]).save(root / "train/n02105855/n02105855_2933.JPEG", format="PNG")
    _photo(COLOURS["n01443537"]).convert("L").save(root / "train/n01443537/n01443537_7.JPEG", quality=95)
    (root / "val").mkdir()
    for name, w in VAL:
        _photo(COLOURS[w]).save(root / "val" / name, quality=95)
    return root


def _write_meta_mat(path: Path) -> None:
    """The devkit's meta.mat: a 'synsets' struct array (leaves have num_children 0) as scipy writes it."""
    from scipy.io import savemat

    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    rows = [(ILSVRC_ID[w], w, w, "", 0, np.zeros((1, 0)), 0, 1300) for w in WNIDS]
    rows.append((1001, "n00001740", "entity", "", 3, np.array([[449, 450, 235]]), 19, 0))  # an inner node
    synsets = np.empty((len(rows), 1), dtype=[(f, object) for f in fields])
    for k, r in enumerate(rows):
        synsets[k, 0] = r
    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(str(path), {"synsets": synsets})


def _val_labels(splits) -> list[tuple[str, str]]:
    classes = splits.info["classes"]
    return [(Path(p).name, classes[i]) for p, i in splits.val.samples]


def test_cmyk_png_and_grey_training_files_decode_to_rgb(tmp_path):
    root = make_imagenet(tmp_path / "imagenet")
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"{Path(n).stem},{w} 1 2 30 20 {w} 3 3 9 9 \n" for n, w in VAL))
    splits = DATASETS.build("imagefolder", {"path": str(root), "image_size": 32, "resize_size": 32})
    assert splits.info["classes"] == WNIDS and splits.info["train_images"] == 3 * 2 + 3
    with Image.open(root / "train/n01440764/n01440764_18.JPEG") as im:
        assert im.mode == "CMYK"
    cmyk = np.asarray(open_image(str(root / "train/n01440764/n01440764_18.JPEG")), np.float32)
    assert cmyk.shape == (32, 40, 3)
    assert np.abs(cmyk[0, 0] - np.array(COLOURS["n01440764"])).max() < 12  # colour survives CMYK -> RGB
    png = open_image(str(root / "train/n02105855/n02105855_2933.JPEG"), draft_size=(20, 16))
    assert png.size == (40, 32) and tuple(np.asarray(png)[0, 0]) == COLOURS["n02105855"]
    for i, (path, label) in enumerate(splits.train.samples):
        if Path(path).name in ("n01440764_18.JPEG", "n02105855_2933.JPEG", "n01443537_7.JPEG"):
            item = splits.train[i]
            assert item["image"].shape == (3, 32, 32) and item["image"].dtype == torch.uint8
            assert int(item["label"]) == label
    assert not any("._" in p for p, _ in splits.train.samples)
    # the Kaggle CSV labels the flat val folder
    assert splits.info["val_layout"].startswith("flat folder, labels from") and "LOC_val_solution.csv" in \
        splits.info["val_layout"]
    assert _val_labels(splits) == VAL


def test_kaggle_layout_finds_csv_three_levels_up(tmp_path):
    comp = tmp_path / "imagenet-object-localization-challenge"
    root = make_imagenet(comp / "ILSVRC/Data/CLS-LOC")
    (comp / "LOC_synset_mapping.txt").write_text("".join(f"{w} name\n" for w in WNIDS))
    (comp / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"{Path(n).stem},{w} 1 2 30 20 \n" for n, w in VAL))
    splits = DATASETS.build("imagefolder", {"path": str(root), "image_size": 32, "resize_size": 32})
    assert _val_labels(splits) == VAL
    item = splits.val[0]
    assert item["image"].shape == (3, 32, 32) and splits.info["classes"][int(item["label"])] == "n02105855"


def test_devkit_ground_truth_with_meta_mat(tmp_path):
    pytest.importorskip("scipy")
    root = make_imagenet(tmp_path / "imagenet")
    data = root / "ILSVRC2012_devkit_t12/data"
    _write_meta_mat(data / "meta.mat")
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{ILSVRC_ID[w]}\n" for _, w in VAL))
    splits = DATASETS.build("imagefolder", {"path": str(root), "image_size": 32, "resize_size": 32})
    assert _val_labels(splits) == VAL and "ILSVRC2012_validation_ground_truth.txt" in splits.info["val_layout"]


def test_flat_val_problems_warn_or_exit_2(tmp_path, caplog, capsys):
    root = make_imagenet(tmp_path / "imagenet")
    rows = [f"{Path(n).stem},{w} 1 2 3 4" for n, w in VAL[:3]] + ["ILSVRC2012_val_00000099,n01440764 1 1 2 2"]
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING):
        splits = DATASETS.build("imagefolder", {"path": str(root), "image_size": 32, "resize_size": 32})
    assert len(splits.val) == 3
    msg = [r.getMessage() for r in caplog.records if "validation entries skipped" in r.getMessage()]
    assert len(msg) == 1 and "2 validation entries skipped" in msg[0]
    assert "ILSVRC2012_val_00000004.JPEG" in msg[0] and "ILSVRC2012_val_00000099" in msg[0]
    with pytest.raises(DataError, match="invalid=error"):
        DATASETS.build("imagefolder", {"path": str(root), "invalid": "error"})
    (root / "LOC_val_solution.csv").unlink()
    rc = main(["data", "inspect", str(root)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "val folder is flat" in err[0] and "LOC_val_solution.csv" in err[0]


def test_inspect_names_cmyk_png_and_companions(tmp_path):
    root = make_imagenet(tmp_path / "imagenet")
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"{Path(n).stem},{w} 1 2 3 4\n" for n, w in VAL))
    report = inspect_path(root)
    assert report["layout"] == "imagefolder" and "val: flat folder, labels from" in report["detected"]
    assert report["train images"] == 9 and report["val images"] == 4 and report["train classes"] == 3
    an = report["anomalies"]
    assert an["train: CMYK images (converted to RGB)"] == "1 (train/n01440764/n01440764_18.JPEG)"
    assert an["train: PNG files named .JPEG (decoded as PNG)"] == "1 (train/n02105855/n02105855_2933.JPEG)"
    assert an["train: L images (converted to RGB)"] == "1 (train/n01443537/n01443537_7.JPEG)"
    assert an["train: macOS ._ companion files (ignored)"].startswith("3 (train/n01440764/._n01440764_10026.JPEG")


def _truncated_jpeg(path: Path) -> None:
    """A JPEG cut in half, as an interrupted download leaves it (its header still reads)."""
    import io

    buf = io.BytesIO()
    _photo(COLOURS["n01440764"]).resize((200, 160)).save(buf, format="JPEG", quality=95)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_inspect_exits_2_on_files_training_stops_on(tmp_path, capsys):
    root = make_imagenet(tmp_path / "imagenet", val_flat=False)
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"{Path(n).stem},{w} 1 2 3 4\n" for n, w in VAL))
    _truncated_jpeg(root / "train/n01443537/n01443537_99.JPEG")
    (root / "train/n01440764/notes.JPEG").write_text("not an image")
    report = inspect_path(root)
    row = report["anomalies"]["train: image files that do not decode"]
    assert row.startswith("2 (") and "n01443537_99.JPEG" in row and "notes.JPEG" in row
    assert report["unusable"] == {"train: image files that do not decode": 2}
    assert main(["data", "inspect", str(root)]) == 2  # after the report, one line saying why
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 file(s) would stop training" in err[0]
    # with skip_unreadable both are left out of training, the truncated one too (its header reads)
    splits = DATASETS.build("imagefolder", {"path": str(root), "image_size": 32, "resize_size": 32,
                                            "skip_unreadable": True})
    names = {Path(p).name for p, _ in splits.train.samples}
    assert splits.info["train_images"] == 9 and not names & {"n01443537_99.JPEG", "notes.JPEG"}


def test_inspect_val_class_folders_against_train(tmp_path):
    root = make_imagenet(tmp_path / "imagenet", val_flat=False)
    for name, w in VAL:  # sorted val: one training class has no val folder, one val folder is no class
        d = root / "val" / (w if w != "n01443537" else "n09999999")
        d.mkdir(exist_ok=True)
        (root / "val" / name).rename(d / name)
    report = inspect_path(root)
    assert report["unusable"] == {"val: class folders not in train/": 1}
    assert report["anomalies"]["val: class folders not in train/"] == "1 (n09999999)"
    assert report["anomalies"]["val: train/ classes without a val folder (not validated)"] == "1 (n01443537)"
    with pytest.raises(DataError, match="n09999999"):  # what training says about it
        DATASETS.build("imagefolder", {"path": str(root)})


def test_inspect_flat_val_with_a_label_list(tmp_path, capsys):
    root = make_imagenet(tmp_path / "imagenet")
    (root / "val.txt").write_text("".join(f"{n} {WNIDS.index(w)}\n" for n, w in VAL))  # Caffe's val.txt
    report = inspect_path(root, {"val_labels": "val.txt"})
    assert report["val images"] == 4 and "labels from" in report["detected"] and "val.txt" in report["detected"]
    assert main(["data", "inspect", str(root), "--set", "val_labels=val.txt"]) == 0
    assert main(["data", "inspect", str(root), "--set", "channels=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--set channels" in err[0] and "val_labels" in err[0]


def make_tiny_imagenet(root: Path) -> Path:
    """Tiny-ImageNet-200 as downloaded: train/<wnid>/images/*.JPEG beside <wnid>_boxes.txt,
    val/images/val_<n>.JPEG labelled by val/val_annotations.txt (FILE WNID and a box), wnids.txt."""
    for w in WNIDS:
        d = root / "train" / w / "images"
        d.mkdir(parents=True)
        for n in range(2):
            _photo(COLOURS[w]).save(d / f"{w}_{n}.JPEG", quality=95)
        (root / "train" / w / f"{w}_boxes.txt").write_text(f"{w}_0.JPEG\t0\t0\t31\t39\n{w}_1.JPEG\t1\t1\t30\t38\n")
    (root / "val" / "images").mkdir(parents=True)
    rows = []
    for n, (_, w) in enumerate(VAL):
        _photo(COLOURS[w]).save(root / "val" / "images" / f"val_{n}.JPEG", quality=95)
        rows.append(f"val_{n}.JPEG\t{w}\t{n}\t2\t30\t38\n")
    (root / "val" / "val_annotations.txt").write_text("".join(rows))
    (root / "test" / "images").mkdir(parents=True)  # unlabelled: not read
    _photo(COLOURS[WNIDS[0]]).save(root / "test" / "images" / "test_0.JPEG", quality=95)
    (root / "wnids.txt").write_text("".join(f"{w}\n" for w in WNIDS))
    return root


def test_tiny_imagenet_as_downloaded(tmp_path, capsys):
    """Tiny-ImageNet's train/<wnid>/images/ was read as class folders holding no image, and its
    val/ as one class called 'images'; both are read where they lie, val labelled by its
    val_annotations.txt, as torchvision's ImageFolder reads the training tree."""
    root = make_tiny_imagenet(tmp_path / "tiny-imagenet-200")
    splits = DATASETS.build("imagefolder", {"path": str(root), "image_size": 28, "resize_size": 32})
    assert splits.info["classes"] == WNIDS and len(splits.train.samples) == 6
    assert [(Path(p).parent.name, Path(p).parent.parent.name, splits.info["classes"][i])
            for p, i in splits.train.samples] == [("images", w, w) for w in WNIDS for _ in range(2)]
    assert _val_labels(splits) == [(f"val_{n}.JPEG", w) for n, (_, w) in enumerate(VAL)]
    assert "val_annotations.txt" in splits.info["val_layout"]
    x = splits.val[0]
    assert x["image"].shape == (3, 28, 28) and splits.info["classes"][int(x["label"])] == VAL[0][1]
    assert main(["data", "inspect", str(root)]) == 0
    assert "imagefolder dataset" in capsys.readouterr().out  # not val/images/ taken for slides
    report = inspect_path(root)
    assert report["layout"] == "imagefolder" and "val_annotations.txt" in report["detected"]
    assert report["train images"] == 6 and report["val images"] == 4 and report["val classes"] == 3
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn01440764\t1\n")  # not the 6 columns
    with pytest.raises(DataError, match="val_annotations.txt:1"):
        DATASETS.build("imagefolder", {"path": str(root)})


def test_no_val_folder_names_the_key_and_inspect_says_training_stops(tmp_path, capsys):
    """train/ + validation/ (Kaggle's and others' name): training said 'image folder not found: .../val'
    and data inspect found no anomaly, exit 0; now training names the folders there and data.args.val_dir,
    inspect lists it as what training stops on (exit 2), and val_dir trains on it."""
    root = make_imagenet(tmp_path / "imagenet")
    (root / "val").rename(root / "validation")
    with pytest.raises(DataError, match=r"imagenet/val: no validation folder \(folders in .*imagenet: train/, "
                                        r"validation/\); name yours with --set data.args.val_dir=NAME$"):
        DATASETS.build("imagefolder", {"path": str(root)})
    report = inspect_path(root)
    assert list(report["unusable"]) == ["val/ missing (training validates on it; a folder of another name: "
                                        "data.args.val_dir)"]
    assert main(["data", "inspect", str(root)]) == 2
    assert "would stop training (val/ missing" in capsys.readouterr().err
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"{Path(n).stem},{w} 1 2 3 4\n" for n, w in VAL))
    splits = DATASETS.build("imagefolder", {"path": str(root), "val_dir": "validation"})
    assert splits.info["val_images"] == len(VAL)
