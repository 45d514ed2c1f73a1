"""Classification task: loss conventions vs torch, exact top-k and AUC sums on crafted cases,
MixUp, device normalisation, and a two-step smoke test of every classification recipe."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastvision import config
from fastvision.losses import CrossEntropyLoss
from fastvision.tasks.classify import (
    AUC_BINS,
    ClassificationTask,
    beta_symmetric,
    histogram_auc,
)


def _task(**kw) -> ClassificationTask:
    return ClassificationTask(loss=CrossEntropyLoss(label_smoothing=kw.pop("smoothing", 0.1)), **kw)


@pytest.mark.parametrize("data_classes, warned", [(4, True), (10, False), (0, False)])  # 0: not known
def test_a_head_larger_than_the_datasets_classes_is_one_warning(data_classes, warned, caplog):
    """resnet18-imagefolder's 10-way head on a 4-class folder trained 6 classes no label names, without a word."""
    caplog.set_level("WARNING", logger="fastvision.tasks.classify")
    task = _task(num_classes=10, info={"num_classes": data_classes} if data_classes else None)
    task.check_model(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 10)))
    said = [r.getMessage() for r in caplog.records]
    assert said == (["task.args.num_classes is 10 but the dataset has 4 classes: the head scores 6 classes no label "
                     "names; set task.args.num_classes and model.args.num_classes to 4"] if warned else [])


def test_label_smoothing_loss_equals_torch():
    torch.manual_seed(0)
    logits, label = torch.randn(6, 5), torch.randint(0, 5, (6,))
    got = _task(num_classes=5).loss(logits, {"label": label})
    torch.testing.assert_close(got, F.cross_entropy(logits, label, label_smoothing=0.1))


@pytest.mark.parametrize("weight", [None, [1.0, 4.0, 0.5]])
def test_val_loss_is_the_loss_over_the_whole_set_in_any_batches(weight):
    """val_loss of a set cut into batches of different class mixes equals torch's loss over the whole set
    at once; with loss.args.weight it was a mean of batch means (the batch's count times its weighted mean),
    which moved with the validation batch size."""
    torch.manual_seed(0)
    logits, label = torch.randn(10, 3), torch.tensor([0, 0, 0, 1, 2, 1, 1, 1, 2, 0])
    task = ClassificationTask(num_classes=3, loss=CrossEntropyLoss(weight=weight, label_smoothing=0.1))
    ev = task.evaluator()
    for lo, hi in ((0, 3), (3, 4), (4, 10)):
        ev.update(logits[lo:hi], {"label": label[lo:hi]})
    w = None if weight is None else torch.tensor(weight)
    whole = F.cross_entropy(logits.double(), label, weight=None if w is None else w.double(), label_smoothing=0.1)
    assert ev.compute()["val_loss"] == pytest.approx(float(whole), rel=1e-6)  # the loss is float32
    assert ev.compute()["top1"] == float((logits.argmax(1) == label).double().mean())


def test_mixup_loss_is_mixture_of_ces():
    """DLE's mixup.py: one Beta(a, a) weight c per batch and a random permutation; x' = c x + (1 - c) x[perm],
    the one-hot targets mixed alike. The weight and the partners are read back from the soft labels."""
    torch.manual_seed(0)
    task = _task(num_classes=8, mixup=0.2)
    batch = {"image": torch.rand(8, 3, 8, 8), "label": torch.arange(8)}  # one class per image
    out = task.augment(batch, torch.Generator().manual_seed(3))
    soft = out["soft_label"]
    lam = soft.gather(1, batch["label"].view(-1, 1)).squeeze(1)
    partner = torch.where(soft.diagonal() < 1, (soft - torch.diag(soft.diagonal())).argmax(1), batch["label"])
    assert sorted(partner.tolist()) == list(range(8))  # a permutation
    assert not torch.equal(partner, batch["label"].flip(0))  # not the reversed batch of before
    one = lam[partner != batch["label"]]
    torch.testing.assert_close(one, one[:1].expand_as(one))  # one weight for the batch
    w = lam.view(-1, 1, 1, 1)
    torch.testing.assert_close(out["image"], w * batch["image"] + (1 - w) * batch["image"][partner])
    out2 = task.augment(batch, torch.Generator().manual_seed(3))
    torch.testing.assert_close(out2["image"], out["image"], rtol=0, atol=0)  # the generator decides
    logits = torch.randn(8, 8)
    ref = torch.stack([lam[i] * F.cross_entropy(logits[i:i + 1], batch["label"][i:i + 1], label_smoothing=0.1)
                       + (1 - lam[i]) * F.cross_entropy(logits[i:i + 1], partner[i:i + 1], label_smoothing=0.1)
                       for i in range(8)]).mean()
    torch.testing.assert_close(task.loss(logits, out), ref)


def test_beta_symmetric_moments():
    lam = beta_symmetric(40000, 0.2, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert lam.min() >= 0 and lam.max() <= 1
    # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)) = 0.17857 for a = 0.2
    assert abs(lam.mean().item() - 0.5) < 0.01
    assert abs(lam.var().item() - 1 / (4 * 1.4)) < 0.005


def test_to_device_and_normalise():
    task = _task(num_classes=3)
    img = torch.tensor([0, 128, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2).contiguous()
    b = task.to_device({"image": img, "label": torch.tensor([0, 1])}, torch.device("cpu"), channels_last=True)
    assert b["image"].dtype == torch.float32 and b["image"].is_contiguous(memory_format=torch.channels_last)
    x = task.normalise(b["image"])
    expected = [(0 - 123.68) / 58.395, (128 - 116.28) / 57.12, (255 - 103.53) / 57.385]
    torch.testing.assert_close(x[0, :, 0, 0], torch.tensor(expected))


def test_topk_exact_on_crafted_cases():
    task = _task(num_classes=6, smoothing=0.0)
    # sample 0: target is best -> top1, top5; sample 1: target 2nd -> top5 only;
    # sample 2: target 6th (last) -> neither; sample 3: target 5th -> top5 only
    logits = torch.tensor([[9., 1, 2, 3, 4, 5], [1., 9, 2, 3, 4, 5], [6., 5, 4, 3, 2, 1], [6., 5, 4, 3, 2, 1]])
    label = torch.tensor([0, 5, 5, 4])
    ev1, ev2 = task.evaluator(), task.evaluator()
    ev1.update(logits[:2], {"label": label[:2]})
    ev2.update(logits[2:], {"label": label[2:]})
    merged = task.evaluator()
    merged.load_state(ev1.state() + ev2.state())  # what the all-reduce does across ranks
    out = merged.compute()
    assert out["top1"] == 1 / 4 and out["top5"] == 3 / 4
    assert out["val_loss"] == pytest.approx(F.cross_entropy(logits, label).item())


@pytest.mark.parametrize("classes", [2, 5])
def test_top5_is_not_reported_with_five_classes_or_fewer(classes, capsys):
    # every label is among the 5 best there, so top-5 would read 1 for any model
    task = _task(num_classes=classes, smoothing=0.0)
    ev = task.evaluator()
    logits = torch.zeros(3, classes)
    logits[:, 0] = 1.0
    ev.update(logits, {"label": torch.tensor([classes - 1, 1, 0])})
    out = ev.compute()
    assert "top5" not in out and out["top1"] == pytest.approx(1 / 3)
    from fastvision.engine.loop import check_target_metric
    from fastvision.errors import ConfigError

    with pytest.raises(ConfigError, match="--target top5: not a metric of this run"):
        check_target_metric(task, "top5=0.9")


def test_auc_matches_mann_whitney():
    rng = np.random.default_rng(0)
    n = 300
    label = torch.from_numpy(rng.integers(0, 2, n))
    p = torch.from_numpy(np.clip(rng.normal(0.4 + 0.25 * label.numpy(), 0.15), 0.0005, 0.9995))
    logits = torch.stack([torch.zeros(n), torch.log(p / (1 - p))], 1).float()  # softmax[:, 1] == p
    task = _task(num_classes=2, auc=True)
    ev = task.evaluator()
    ev.update(logits, {"label": label})
    score = logits.softmax(1)[:, 1].numpy()
    pos, neg = score[label.numpy() == 1], score[label.numpy() == 0]
    wins = sum((a > b) + 0.5 * (a == b) for a, b in itertools.product(pos, neg))
    assert ev.compute()["auc"] == pytest.approx(wins / (len(pos) * len(neg)), abs=2 / AUC_BINS)
    # hand case on histograms: neg in bins 0, 1; pos in bins 1, 2 -> (0.5*1*1 + ...) / 4
    neg_h, pos_h = np.array([1, 1, 0]), np.array([0, 1, 1])
    # pairs: pos@1 vs neg@0 win, vs neg@1 tie; pos@2 wins both -> (1 + 0.5 + 2) / 4
    assert histogram_auc(neg_h, pos_h) == pytest.approx(3.5 / 4)


def test_auc_of_a_confident_model_is_the_mann_whitney_one():
    """A confident model's probabilities crowd into 0.999-1 (margins 7 to 15): a histogram of
    probabilities ties them all (AUC 0.5 here, 0.7 points low on a realistic mix); the exact AUC
    from the scores' ranks is what sklearn's roc_auc_score gives."""
    rng = np.random.default_rng(1)
    pos, neg = rng.uniform(7, 15, 200), rng.uniform(7, 15, 150) - 1.0  # overlapping, all p > 0.999
    margin = np.concatenate([pos, neg])
    label = torch.tensor([1] * len(pos) + [0] * len(neg))
    logits = torch.from_numpy(np.stack([np.zeros_like(margin), margin], 1)).float()
    ev = _task(num_classes=2, auc=True).evaluator()
    ev.update(logits[::2], {"label": label[::2]})
    ev.update(logits[1::2], {"label": label[1::2]})
    ranks = np.argsort(np.argsort(margin)) + 1  # distinct margins: no ties
    exact = (ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))
    assert 0.55 < exact < 0.8
    assert ev.compute()["auc"] == pytest.approx(exact, abs=2e-3)
    three = _task(num_classes=3, auc=True).evaluator()  # class 1 against the rest: its softmax's logit
    logits3 = torch.cat([logits, torch.full((len(margin), 1), -30.0)], 1)
    three.update(logits3, {"label": label})
    assert three.compute()["auc"] == pytest.approx(exact, abs=2e-3)


def test_synthetic_batch():
    b = _task(num_classes=7, image_size=16).synthetic_batch(3, torch.device("cpu"))
    assert b["image"].shape == (3, 3, 16, 16) and b["label"].max() < 7


# ------------------------------------------------------------------- recipe smoke tests

def _smoke(recipe, data, tmp_path, *sets):
    from fastvision.api import run_training

    extra = [config.parse_override(s) for s in (f"data.args.path={data}", "train.epochs=1", "train.steps_per_epoch=2",
                                                "train.batch_size=2", "train.target=null",
                                                "data.loader=threads", "data.num_workers=0", "examples=0", *sets)]
    extra.append({"train": {"amp": "off"}})  # YAML would read a bare `off` as False
    return run_training(recipe, out=str(tmp_path / "run"), extra=extra, progress=False)


@pytest.mark.slow
def test_recipe_resnet50_imagenet_two_steps(tmp_path):
    from fastvision.data.synth.imagenet import synth

    data = synth(tmp_path / "d", classes=3, per_class=2, val_per_class=1, size=40)
    s = _smoke("resnet50-imagenet", data, tmp_path, "data.args.image_size=32", "data.args.resize_size=36",
               "task.args.num_classes=3", "model.args.num_classes=3", "task.args.mixup=0.2")
    assert 0 <= s["top1"] <= 1 and np.isfinite(s["train_loss"])


def test_recipe_resnet18_imagefolder_two_steps(tmp_path):
    from fastvision.data.synth.imagenet import synth

    data = synth(tmp_path / "d", classes=10, per_class=1, val_per_class=1, size=40)
    s = _smoke("resnet18-imagefolder", data, tmp_path, "data.args.image_size=32", "data.args.resize_size=36")
    assert 0 <= s["top1"] <= 1 and s["top5"] >= s["top1"] and np.isfinite(s["train_loss"])


def test_recipe_resnet18_pathology_two_steps_heatmap_and_froc(tmp_path, monkeypatch):
    """Two training steps, then from the CLI: `predict` on the validation slides writes heat maps,
    and `froc` scores them against the masks (slide_000 is a tumour slide, slide_001 normal)."""
    import json

    import tifffile

    from fastvision import cli
    from fastvision.data.synth.pathology import synth

    data = synth(tmp_path / "d", slides=2, val_slides=2, size=256, tile=64)
    s = _smoke("resnet18-pathology", data, tmp_path, "data.args.patch_size=32", "task.args.heatmap_patch=32")
    assert 0 <= s["auc"] <= 1 and 0 <= s["top1"] <= 1
    assert cli.main(["predict", str(tmp_path / "run"), str(data / "val" / "images"), "--out", str(tmp_path / "pred"),
                     "--device", "cpu"]) == 0
    assert sorted(p.name for p in (tmp_path / "pred").iterdir()) == [
        "slide_000_heatmap.png", "slide_000_heatmap.tif", "slide_001_heatmap.png", "slide_001_heatmap.tif"]
    heat = tifffile.imread(tmp_path / "pred" / "slide_000_heatmap.tif")
    assert heat.shape == (8, 8) and (heat >= 0).all() and (heat <= 1).all()
    from fastvision.data.formats.heatmap import heatmap_record

    assert heatmap_record(tmp_path / "pred" / "slide_000_heatmap.png") == {"stride": 32, "patch": 32}
    assert cli.main(["froc", str(tmp_path / "pred"), str(data / "val" / "masks"), "--threshold", "0",
                     "--json", str(tmp_path / "froc.json")]) == 0
    out = json.loads((tmp_path / "froc.json").read_text())
    assert (out["slides"], out["tumour_slides"]) == (2, 1) and out["lesions"] >= 1 and 0 <= out["froc"] <= 1


@pytest.mark.slow
def test_resnet18_imagefolder_reaches_90_top1(tmp_path):
    """The issue's CPU check at CI size: 10 generated classes (50 train / 20 val JPEGs each, 32 px),
    the shipped recipe at 28 px crops; its target top1=0.9 stops the run once reached (epoch 5 for
    seeds 0-2 on the sandbox; 8 epochs end at 0.98), in about 20 s on 2 CPU cores."""
    from fastvision.api import run_training
    from fastvision.data.synth.imagenet import synth

    data = synth(tmp_path / "d", classes=10, per_class=50, val_per_class=20, size=32)
    extra = [config.parse_override(s) for s in (f"data.args.path={data}", "data.args.image_size=28",
                                                "data.args.resize_size=32", "train.batch_size=32", "examples=0")]
    s = run_training("resnet18-imagefolder", out=str(tmp_path / "run"), extra=extra + [{"train": {"device": "cpu"}}],
                     progress=False)
    assert s["target_reached"] and s["top1"] >= 0.9


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(config.TrainConfig(), "ema_decay"), reason="train.ema_decay not wired in the engine")
def test_ema_weights_follow_the_hand_formula(tmp_path):
    """Three one-step epochs, each resumed from the last checkpoint: the saved EMA must be
    e1 = w1, e_k = d e_(k-1) + (1 - d) w_k over the raw weights w_k (floats: parameters and BN
    statistics), and evaluate/predict must load the EMA weights."""
    from fastvision.api import load_run, run_training
    from fastvision.data.synth.imagenet import synth
    from fastvision.engine.checkpoint import load

    d = 0.6
    data = synth(tmp_path / "d", classes=3, per_class=2, val_per_class=1, size=36)
    sets = [f"data.args.path={data}", "data.args.image_size=32", "data.args.resize_size=36", "task.args.num_classes=3",
            "model.args.num_classes=3", "model.args.zero_init_residual=false", "train.steps_per_epoch=1",
            "train.batch_size=2", "train.target=null", "optim.lr=25.6", "sched.name=constant",
            "sched.warmup_epochs=0", f"train.ema_decay={d}", "examples=0"]
    ckpts, resume = [], None
    for k in (1, 2, 3):
        extra = [config.parse_override(s) for s in (*sets, f"train.epochs={k}")] + [{"train": {"device": "cpu"}}]
        run_training("resnet18-imagefolder", out=str(tmp_path / f"r{k}"), resume=resume, extra=extra, progress=False)
        resume = str(tmp_path / f"r{k}" / "checkpoints" / "last.pt")
        ckpts.append(load(resume))
    w = [c["model"] for c in ckpts]
    floats = [k for k, v in w[0].items() if v.is_floating_point()]
    want = {k: d * d * w[0][k] + d * (1 - d) * w[1][k] + (1 - d) * w[2][k] for k in floats}
    got = ckpts[2]["eval_model"]
    assert max((got[k] - w[2][k]).abs().max().item() for k in floats) > 1e-3  # EMA differs from raw weights
    for k in floats:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    run, _ = load_run(tmp_path / "r3" / "checkpoints" / "last.pt", device="cpu")
    for k, v in run.model.state_dict().items():
        torch.testing.assert_close(v, got[k])


def test_cli_predict_and_evaluate_imagefolder(tmp_path):
    """`fastvision predict RUN folder` writes class index + name + probability equal to the model's
    softmax on the validation items of the same files; `fastvision evaluate --json` reports the
    metrics the run logged for its best checkpoint."""
    import csv
    import json

    from fastvision.api import load_run
    from fastvision.cli import main
    from fastvision.data.synth.imagenet import synth

    data = synth(tmp_path / "d", classes=3, per_class=2, val_per_class=2, size=40)
    s = _smoke("resnet18-imagefolder", data, tmp_path, "data.args.image_size=32", "data.args.resize_size=36",
               "task.args.num_classes=3", "model.args.num_classes=3")
    run_dir = tmp_path / "run"
    assert main(["predict", str(run_dir), str(data / "val" / "class001"), str(data / "val" / "class002" / "00000.JPEG"),
                 "--out", str(tmp_path / "p"), "--device", "cpu"]) == 0
    with open(tmp_path / "p" / "predictions.csv") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["file", "class", "class_name", "probability"] and len(rows) == 4
    run, _ = load_run(run_dir, device="cpu")
    by_id = {run.val_set[i]["id"]: run.val_set[i] for i in range(len(run.val_set))}
    for path, cls, name, prob in rows[1:]:
        item = next(v for k, v in by_id.items() if k.endswith(path.split("/val/")[1]))
        with torch.no_grad():
            ref = run.task.forward(run.model, run.task.to_device({"image": item["image"][None]}, torch.device("cpu")))
        ref = ref.softmax(1)[0]
        assert int(cls) == int(ref.argmax()) and name == f"class{int(cls):03d}"
        assert float(prob) == pytest.approx(float(ref.max()), abs=1e-5)
    whole = (data / "val" / "class001" / "00000.JPEG").read_bytes()
    (tmp_path / "cut.JPEG").write_bytes(whole[: len(whole) // 2])  # a truncated download among the inputs
    assert main(["predict", str(run_dir), str(data / "val" / "class001"), str(tmp_path / "cut.JPEG"),
                 "--out", str(tmp_path / "p2"), "--device", "cpu"]) == 2
    assert not (tmp_path / "p2").exists()  # one line naming it, and not even an empty --out left behind
    assert main(["evaluate", str(run_dir), "--device", "cpu", "--json", str(tmp_path / "e.json")]) == 0
    ev = json.loads((tmp_path / "e.json").read_text())
    assert ev["items"] == 6
    assert ev["top1"] == pytest.approx(s["top1"]) and ev["val_loss"] == pytest.approx(s["val_loss"])
    # the validation split itself (class folders inside the input folder, as timm's reader takes it):
    # one row per image, and their top-1 against the folder names is evaluate's
    assert main(["predict", str(run_dir), str(data / "val"), "--out", str(tmp_path / "p3"), "--device", "cpu"]) == 0
    with open(tmp_path / "p3" / "predictions.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6
    assert sum(r["class_name"] == Path(r["file"]).parent.name for r in rows) / 6 == pytest.approx(ev["top1"])


def test_dataset_with_more_classes_than_the_task_is_a_config_error(tmp_path):
    from fastvision.api import run_training
    from fastvision.data.synth.imagenet import synth
    from fastvision.errors import ConfigError

    data = synth(tmp_path / "d", classes=4, per_class=1, val_per_class=1, size=36)
    extra = [config.parse_override(f"data.args.path={data}"), config.parse_override("task.args.num_classes=3")]
    with pytest.raises(ConfigError, match="task.args.num_classes is 3 but the dataset has 4 classes"):
        run_training("resnet18-imagefolder", out=str(tmp_path / "run"), extra=extra + [{"train": {"device": "cpu"}}],
                     progress=False)


@pytest.mark.parametrize("args,key", [
    (["--target", "top1=90"], "--target top1=90: top1 is a fraction"),  # a timm user's percent: never reached
    (["--target", "top5=-0.5"], "--target top5=-0.5: top5 is a fraction"),
    (["--set", "task.args.mixup=-1"], "task.args.mixup=-1"),  # was MixUp off without a word
    (["--set", "loss.args.label_smoothing=1.5"], "loss.args.label_smoothing=1.5"),  # was the first step's error
    (["--set", "model.args.num_classes=5"], "model.args.num_classes gives a head of 5"),  # was "Target 9 is out of ..."
    (["--set", "task.args.num_classes=20"], "task.args.num_classes is 20"),  # was trained against a 10-class head
    # was the first step's "grad can be implicitly created only for scalar outputs ... Check model 'resnet18'"
    (["--set", "loss.args.reduction=none"], "loss.args.reduction=none: classification trains on each batch's mean"),
    # was a loss summed over the batch (the LR times the batch) and a val_loss of the batch sum times its size
    (["--set", "loss.args.reduction=sum"], "loss.args.reduction=sum: classification trains on each batch's mean"),
])
def test_settings_the_run_cannot_use_are_one_line_before_the_run_folder(tmp_path, capsys, args, key):
    from fastvision.cli import main
    from fastvision.data.synth.imagenet import synth

    data = synth(tmp_path / "d", classes=10, per_class=1, val_per_class=1, size=36)  # the recipe's 10
    out = tmp_path / "run"
    assert main(["train", "resnet18-imagefolder", "--data", str(data), "--out", str(out), "--device", "cpu",
                 "--epochs", "1", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err
    assert not out.exists()


def test_evaluate_data_is_read_in_place_of_the_training_data_with_the_same_classes(tmp_path, capsys):
    """`evaluate RUN --data NEW` after the training folder moved evaluates NEW (it built the gone
    folder first: 'dataset folder not found ... (pass --data DIR)'); a folder whose class list is
    not the training one (a class missing in the middle, so every later label shifts) is one line,
    as are more classes than the head (was 'set task.args.num_classes', no key of evaluate)."""
    import json
    import shutil

    from fastvision.cli import main
    from fastvision.data.synth.imagenet import synth

    data = synth(tmp_path / "d", classes=3, per_class=2, val_per_class=2, size=40)
    _smoke("resnet18-imagefolder", data, tmp_path, "data.args.image_size=32", "data.args.resize_size=36",
           "task.args.num_classes=3", "model.args.num_classes=3")
    run_dir = tmp_path / "run"
    assert main(["evaluate", str(run_dir), "--device", "cpu", "--json", str(tmp_path / "a.json")]) == 0
    moved = tmp_path / "moved"
    data.rename(moved)
    assert main(["evaluate", str(run_dir), "--data", str(moved), "--device", "cpu",
                 "--json", str(tmp_path / "b.json")]) == 0
    top1 = [json.loads((tmp_path / f"{n}.json").read_text())["top1"] for n in "ab"]
    assert top1[0] == top1[1]
    capsys.readouterr()
    shifted = tmp_path / "shifted"
    shutil.copytree(moved, shifted)
    for split in ("train", "val"):
        shutil.rmtree(shifted / split / "class001")
    more = synth(tmp_path / "more", classes=4, per_class=1, val_per_class=1, size=40)
    for folder, why in ((shifted, "class 1 is 'class002' there, 'class001' in training"),
                        (more, "4 classes there, 3 in training")):
        assert main(["evaluate", str(run_dir), "--data", str(folder), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--data {folder}: its classes are not those" in err[0] and why in err[0], err
    prefix = tmp_path / "prefix"  # the first training classes alone keep their indices: evaluated
    shutil.copytree(moved, prefix)
    for split in ("train", "val"):
        shutil.rmtree(prefix / split / "class002")
    assert main(["evaluate", str(run_dir), "--data", str(prefix), "--device", "cpu"]) == 0


def test_predict_on_a_slide_smaller_than_the_patch_is_one_line_before_any_heat_map(tmp_path):
    """A slide below heatmap_patch has no cell: its heat map was an empty array (a zero-size TIFF,
    then a ValueError traceback from the PNG writer) after the slides before it were written."""
    from types import SimpleNamespace

    import tifffile

    from fastvision.errors import DataError

    tifffile.imwrite(tmp_path / "a_big.tif", np.full((64, 64, 3), 100, np.uint8), tile=(16, 16))
    tifffile.imwrite(tmp_path / "b_small.tif", np.zeros((20, 48, 3), np.uint8), tile=(16, 16))
    task = _task(num_classes=2, heatmap_patch=32)
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2))
    cfg = SimpleNamespace(data=SimpleNamespace(args={"patch_size": 32}))
    out = tmp_path / "out"
    out.mkdir()
    files = [tmp_path / "a_big.tif", tmp_path / "b_small.tif"]
    with pytest.raises(DataError, match=r"b_small.tif: 20 x 48 px at level 0, smaller than the heat map.s patch of 32"):
        task.predict_files(model, files, out, cfg, torch.device("cpu"))
    assert list(out.iterdir()) == []
    written = task.predict_files(model, files[:1], out, cfg, torch.device("cpu"))
    assert tifffile.imread(out / "a_big_heatmap.tif").shape == (2, 2) and len(written) == 2


def test_predict_reads_slides_at_the_trained_level_and_records_level0_pixels(tmp_path):
    """A run trained at data.args.level=1 scored level-0 patches (twice the magnification it learned
    at, a heat map of twice the cells); the heat map is of level 1 now, its stride and patch recorded
    in level-0 pixels, those of the masks froc reads, so froc places each cell on the lesion."""
    from types import SimpleNamespace

    import tifffile

    from fastvision.data.formats.heatmap import heatmap_record, slide_heatmap
    from fastvision.metrics.froc import froc_files

    img = np.full((256, 256, 3), 200, np.uint8)
    img[64:128, 128:192] = 20  # one dark lesion, level-0 rows 64-127, columns 128-191
    mask = (img[..., 0] < 100).astype(np.uint8)
    for name, level0 in (("s.tif", img), ("m.tif", mask)):
        with tifffile.TiffWriter(tmp_path / name) as t:
            t.write(level0, tile=(32, 32), subifds=1)
            t.write(level0[::2, ::2], tile=(32, 32), subfiletype=1)
    dark = lambda x: 1 - x.float().mean((1, 2, 3)) / 255  # noqa: E731  (darker patch, higher score)
    heat = slide_heatmap(tmp_path / "s.tif", dark, patch_size=32, level=1)
    half = img[::2, ::2].astype(np.float64)
    np.testing.assert_allclose(heat, 1 - half.reshape(4, 32, 4, 32, 3).mean((1, 3, 4)) / 255, rtol=1e-5)
    task = _task(num_classes=2, heatmap_patch=32)
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2))
    with torch.no_grad():  # logit of class 1 = -(sum of the normalised means): dark patches score high
        model[2].weight.copy_(torch.tensor([[0.0, 0, 0], [-1.0, -1, -1]]))
        model[2].bias.zero_()
    cfg = SimpleNamespace(data=SimpleNamespace(args={"patch_size": 32, "level": 1}))
    (tmp_path / "heat").mkdir()
    task.predict_files(model, [tmp_path / "s.tif"], tmp_path / "heat", cfg, torch.device("cpu"))
    out = tifffile.imread(tmp_path / "heat" / "s_heatmap.tif")
    assert out.shape == (4, 4) and np.unravel_index(out.argmax(), out.shape) == (1, 2)  # level-1 cell of the lesion
    assert heatmap_record(tmp_path / "heat" / "s_heatmap.tif") == {"stride": 64, "patch": 64}
    (tmp_path / "masks").mkdir()
    (tmp_path / "m.tif").rename(tmp_path / "masks" / "s.tif")
    (tmp_path / "normal").mkdir()  # a second slide, normal, with one false positive below the lesion's score
    fp = np.zeros((4, 4), np.float32)
    fp[3, 0] = 0.6
    tifffile.imwrite(tmp_path / "heat" / "n_heatmap.tif", fp)
    res = froc_files(tmp_path / "heat", tmp_path / "masks", threshold=0.55, nms_radius=0)
    assert res["lesions"] == 1 and res["sens@0.5"] == 1.0  # the lesion's cell lands on it at the recorded stride


@pytest.mark.parametrize("kw, needle", [
    # torchvision's / timm's 0-1 values: taken as 0-255 ones they subtracted no mean and scaled by 255
    ({"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
     r"in 0-255 units, as the images arrive \(torchvision's 0-1 values times 255: mean=\[123.675, 116.28, 103.53\]"),
    ({"mean": [1.0, 2.0]}, r"task.args.mean=\[1.0, 2.0\]: one value per RGB channel \(3\)"),  # was a RuntimeError
    ({"std": [58.0, 0.0, 57.0]}, r"task.args.std=\[58.0, 0.0, 57.0\]: each above 0"),
])
def test_mean_and_std_outside_0_255_units_are_one_line(kw, needle):
    from fastvision.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        _task(num_classes=3, **kw)
    assert _task(num_classes=3, mean=[128.0, 128.0, 128.0], std=[64.0, 64.0, 64.0]).num_classes == 3


def test_predict_with_a_truncated_image_after_good_ones_is_one_line_before_any_work(tmp_path):
    # the rows of the images before it were computed, then dropped (predictions.csv is written at the end);
    # every input is now checked to decode before the first, as detection's predict does
    from types import SimpleNamespace

    from PIL import Image

    from fastvision.errors import DataError

    rng = np.random.default_rng(0)
    files = []
    for name in ("a.jpg", "b.jpg"):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(tmp_path / name)
        files.append(tmp_path / name)
    cut = files[1].read_bytes()
    files[1].write_bytes(cut[: len(cut) * 3 // 4])
    task = _task(num_classes=2, image_size=32)
    calls = []
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2))
    model.register_forward_hook(lambda *a: calls.append(1))
    cfg = SimpleNamespace(data=SimpleNamespace(args={"image_size": 32}))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=r"cannot read image .*b\.jpg: .*nothing was written"):
        task.predict_files(model, files, out, cfg, torch.device("cpu"))
    assert calls == [] and list(out.iterdir()) == []  # no image predicted, none written
    written = task.predict_files(model, files[:1], out, cfg, torch.device("cpu"))
    assert [p.name for p in written] == ["predictions.csv"] and len(calls) == 1
