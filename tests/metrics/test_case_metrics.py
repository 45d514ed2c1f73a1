"""Per-case segmentation metrics: against MONAI's DiceMetric / MeanIoU on multi-case batches with
empty classes, BraTS WT/TC/ET per case by hand, and 2 gloo ranks against 1 rank (bit for bit).

Also the worker script of the 2-rank test (``python tests/metrics/test_case_metrics.py OUT``).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # also run as a worker script

from fastvision.losses import DiceLoss  # noqa: E402
from fastvision.metrics.cases import CaseSums, case_counts, case_scores  # noqa: E402
from fastvision.tasks.segment import SegmentationTask  # noqa: E402

REDUCTIONS = ["mean", "mean_batch"]  # the two the evaluator reports (dice, dice/<class>)


def _cases(seed: int = 0, b: int = 5, c: int = 4, shape=(6, 5, 4)):
    """Logits (B, C, *S) and labels (B, *S): case 1 lacks class 3 in truth (but predicts it),
    case 2 lacks class 2 in truth and prediction, case 3 is all background."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, c, *shape, generator=g)
    label = torch.randint(0, c, (b, *shape), generator=g)
    label[1][label[1] == 3] = 1
    logits[1, 3, 0, 0, 0] = 10.0  # a false positive of class 3 in case 1
    label[2][label[2] == 2] = 0
    logits[2, 2] = -10.0
    label[3] = 0
    return logits, label


def _onehot(idx: torch.Tensor, c: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(idx, c).movedim(-1, 1)


if __name__ != "__main__":  # a rank of the 2-rank test compares with no MONAI: seconds of import saved
    monai_metrics = pytest.importorskip("monai.metrics")


def _case_sums(pred, truth, metric="dice", include_background=True, empty="ignore", sums=None) -> CaseSums:
    """Per-case scores accumulated as the evaluator does (case_counts -> case_scores -> CaseSums)."""
    if not include_background:
        pred, truth = pred[:, 1:], truth[:, 1:]
    sums = sums or CaseSums(pred.shape[1])
    sums.update(case_scores(*case_counts(pred, truth), metric, empty))
    return sums


def _reduced(sums: CaseSums, reduction: str):
    """(value, not_nans) as MONAI's aggregate(get_not_nans=True) reports them."""
    c = sums.channels
    if reduction == "mean":
        return torch.tensor(sums.mean()), sums.sums[-1].float()
    return sums.mean_batch(), sums.sums[c:2 * c].float()


@pytest.mark.parametrize("ignore_empty", [True, False])
@pytest.mark.parametrize("include_background", [True, False])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_dice_metric_equals_monai(reduction, include_background, ignore_empty):
    ref = monai_metrics.DiceMetric(include_background=include_background, reduction=reduction, get_not_nans=True,
                                   ignore_empty=ignore_empty)
    sums = None
    for seed in (0, 1):  # two batches: the sums cover both
        logits, label = _cases(seed)
        pred, truth = _onehot(logits.argmax(1), 4), _onehot(label, 4)
        ref(y_pred=pred, y=truth)
        sums = _case_sums(pred, truth, "dice", include_background, "ignore" if ignore_empty else "one", sums)
    (rv, rn), (ov, on) = ref.aggregate(), _reduced(sums, reduction)
    torch.testing.assert_close(ov.float(), rv.float().reshape(ov.shape), equal_nan=True)
    torch.testing.assert_close(on.float(), rn.float().reshape(on.shape))


@pytest.mark.parametrize("ignore_empty", [True, False])
def test_mean_iou_equals_monai(ignore_empty):
    logits, label = _cases(2)
    pred, truth = _onehot(logits.argmax(1), 4), _onehot(label, 4)
    ref = monai_metrics.MeanIoU(include_background=False, reduction="mean_batch", ignore_empty=ignore_empty)
    ref(y_pred=pred, y=truth)
    ours = _case_sums(pred, truth, "iou", False, "ignore" if ignore_empty else "one")
    torch.testing.assert_close(ours.mean_batch().float(), ref.aggregate().float())


@pytest.mark.parametrize("empty,ignore_empty", [("ignore", True), ("one", False)])
def test_evaluator_per_case_equals_monai_and_keeps_pooled(empty, ignore_empty):
    task = SegmentationTask(num_classes=4, empty=empty, loss=DiceLoss(softmax=True))
    ev = task.evaluator()
    mean = monai_metrics.DiceMetric(include_background=False, reduction="mean", ignore_empty=ignore_empty)
    batch_ref = monai_metrics.DiceMetric(include_background=False, reduction="mean_batch", ignore_empty=ignore_empty)
    tp = fp_fn = 0
    for seed, b in ((0, 5), (3, 4)):  # batches of different sizes: every item is a case
        logits, label = _cases(seed, b=b)
        ev.update(logits, {"label": label})
        pred, truth = _onehot(logits.argmax(1), 4), _onehot(label, 4)
        mean(y_pred=pred, y=truth)
        batch_ref(y_pred=pred, y=truth)
        t, p, f = case_counts(pred[:, 1:], truth[:, 1:])
        tp, fp_fn = tp + t.sum(0), fp_fn + (p + f).sum(0)
    out = ev.compute()
    # MONAI reduces in float32
    assert out["dice"] == pytest.approx(float(mean.aggregate()), abs=1e-6)
    for c, v in zip((1, 2, 3), batch_ref.aggregate().tolist(), strict=True):
        assert out[f"dice/{c}"] == pytest.approx(v, abs=1e-6)
    pooled = 2 * tp.double() / (2 * tp + fp_fn).double()
    assert out["dice_pooled"] == pytest.approx(float(pooled.mean()), rel=1e-12)
    assert out["dice"] != pytest.approx(out["dice_pooled"], abs=1e-3)  # the two definitions differ here


def test_pooled_average_keeps_seed001_iou_unsuffixed():
    task = SegmentationTask(num_classes=2, mode="sigmoid", average="pooled", loss=DiceLoss(sigmoid=True))
    ev = task.evaluator()
    label = torch.tensor([[[1, 1, 0, 0]], [[0, 0, 0, 1]]])  # (B=2, 1, 4)
    logits = torch.tensor([[[[1.0, -1.0, -1.0, -1.0]]], [[[1.0, 1.0, 1.0, 1.0]]]])  # (2, 1, 1, 4)
    ev.update(logits, {"label": label})
    out = ev.compute()
    # flattened set: tp 2, fp 3, fn 1 -> IoU 2/6; per case: 1/2 and 1/4
    assert out["iou"] == pytest.approx(2 / 6) and out["iou_case"] == pytest.approx((1 / 2 + 1 / 4) / 2, abs=1e-9)


def test_brats_regions_per_case_by_hand():
    """Softmax labels scored as WT {1,2,3}, TC {1,3}, ET {3} per case, BraTS empty convention."""
    task = SegmentationTask(num_classes=4, regions=[[1, 2, 3], [1, 3], [3]], region_names=["WT", "TC", "ET"],
                            empty="one", loss=DiceLoss(softmax=True))
    label = torch.tensor([[1, 2, 3, 0, 0, 0],    # case 0
                          [2, 2, 0, 0, 0, 0]])   # case 1: no TC, no ET in truth
    pred = torch.tensor([[1, 1, 0, 3, 0, 0],
                         [2, 0, 0, 0, 0, 2]])
    logits = _onehot(pred, 4).float()
    ev = task.evaluator()
    ev.update(logits, {"label": label})
    out = ev.compute()
    # case 0: WT truth {0,1,2} pred {0,1,3}: 2*2/(3+3); TC truth {0,2} pred {0,1,3}: 2*1/5; ET truth {2} pred {3}: 0
    # case 1: WT truth {0,1} pred {0,5}: 2*1/4; TC and ET empty in truth and prediction: 1 each
    wt, tc, et = (4 / 6 + 2 / 4) / 2, (2 / 5 + 1.0) / 2, (0.0 + 1.0) / 2
    assert out["dice/WT"] == pytest.approx(wt, abs=1e-9)
    assert out["dice/TC"] == pytest.approx(tc, abs=1e-9)
    assert out["dice/ET"] == pytest.approx(et, abs=1e-9)
    assert out["dice"] == pytest.approx((wt + tc + et) / 3, abs=1e-9)
    # seed 000's per-label figures ride along: label 2 (edema) case 0: truth {1} pred {} -> 0; case 1: 2*1/4
    assert out["dice/2"] == pytest.approx((0 + 2 / 4) / 2, abs=1e-9) and "dice_labels" in out


def test_case_scores_empty_conventions_by_hand():
    tp, fp, fn = torch.tensor([[0, 0, 2]]), torch.tensor([[0, 3, 1]]), torch.tensor([[0, 0, 1]])
    want = {"ignore": [math.nan, math.nan, 4 / 6], "one": [1.0, 0.0, 4 / 6], "zero": [0.0, 0.0, 4 / 6]}
    for empty, w in want.items():
        torch.testing.assert_close(case_scores(tp, fp, fn, "dice", empty)[0], torch.tensor(w, dtype=torch.float64),
                                   equal_nan=True)
    sums = CaseSums(3)
    sums.update(case_scores(tp, fp, fn, "dice", "ignore"))
    assert sums.mean() == pytest.approx(4 / 6) and int(sums.sums[-1]) == 1


def test_crop_evaluation_predicts_background_outside():
    task = SegmentationTask(num_classes=3, eval="crop", eval_crop=[4, 6], loss=DiceLoss(softmax=True))
    image = torch.randn(1, 3, 6, 4)
    seen = []

    def model(x):
        seen.append(tuple(x.shape))
        return x

    out = task.eval_forward(model, {"image": image})
    assert seen == [(1, 3, 4, 6)] and out.shape == image.shape
    torch.testing.assert_close(out[:, :, 1:5], image[:, :, 1:5])  # rows cropped, columns zero-padded
    assert (out[:, :, [0, 5]].argmax(1) == 0).all()


def test_hd95_is_in_mm_with_the_datas_voxel_size_as_monai_gives_it():
    """An anisotropic set (spleen: 2.5 mm slices): HD95 was in voxels, 2.5x off along z. With the preprocessing's
    target spacing, or a case's own spacing where there is none, it is MONAI's compute_hausdorff_distance(spacing=...);
    without a voxel size it stays in voxels."""
    from monai.metrics import compute_hausdorff_distance

    from fastvision.engine import evaluate, runtime

    g = torch.Generator().manual_seed(3)
    label = torch.zeros(2, 12, 10, 8, dtype=torch.long)
    label[0, 3:9, 2:7, 2:6] = 1
    label[1, 1:6, 4:9, 1:7] = 1
    logits = torch.randn(2, 2, 12, 10, 8, generator=g)
    logits[:, 1] += 2.5 * (label == 1)  # mostly right, with noise at the edges
    cpu = torch.device("cpu")
    onehot = lambda t: torch.stack([t == 0, t == 1], 1).float()  # noqa: E731

    def ours(info, batch_extra):
        task = SegmentationTask(num_classes=2, hd95=True, loss=DiceLoss(softmax=True), info=info)
        loader = [{"image": logits, "label": label, **batch_extra}]
        return evaluate(torch.nn.Identity(), task, loader, cpu, runtime.Precision("off", cpu))["hd95"]

    spacing = (2.5, 0.8, 0.8)
    pred = logits.argmax(1)
    theirs = compute_hausdorff_distance(onehot(pred), onehot(label), percentile=95, spacing=list(spacing))
    assert ours({"preprocess": {"target_spacing": list(spacing)}}, {}) == pytest.approx(float(theirs.mean()), rel=1e-6)
    own = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
    theirs = [float(compute_hausdorff_distance(onehot(pred[i:i + 1]), onehot(label[i:i + 1]), percentile=95,
                                               spacing=own[i].tolist())) for i in range(2)]
    assert ours({}, {"spacing": own}) == pytest.approx(sum(theirs) / 2, rel=1e-6)
    voxels = compute_hausdorff_distance(onehot(pred), onehot(label), percentile=95)
    assert ours({}, {}) == pytest.approx(float(voxels.mean()), rel=1e-6)
    assert float(voxels.mean()) != pytest.approx(float(theirs[0]))  # the spacing does change it here


# --------------------------------------------------------------------------- 2 ranks vs 1


def _eval_cases():
    logits, label = _cases(7, b=7, shape=(5, 4, 3))
    return logits, label


def _evaluate(cases, batch: int) -> dict:
    from fastvision.engine import evaluate, runtime

    logits, label = cases
    task = SegmentationTask(num_classes=4, regions=[[1, 2, 3], [1, 3], [3]], region_names=["WT", "TC", "ET"],
                            empty="one", hd95=True, loss=DiceLoss(softmax=True))
    loader = [{"image": logits[i:i + batch], "label": label[i:i + batch]} for i in range(0, len(label), batch)]
    cpu = torch.device("cpu")
    return evaluate(torch.nn.Identity(), task, loader, cpu, runtime.Precision("off", cpu))


def _rank_worker(out: Path) -> None:
    from fastvision import distributed

    torch.set_num_threads(1)
    env, _ = distributed.init("cpu")
    logits, label = _eval_cases()
    mine = (logits[env.rank::2], label[env.rank::2])  # rank 0: cases 0 2 4 6, rank 1: 1 3 5
    res = _evaluate(mine, batch=2 + env.rank)
    (out / f"rank{env.rank}.json").write_text(json.dumps({k: repr(v) for k, v in res.items()}))
    distributed.barrier()
    distributed.shutdown()


@pytest.mark.dist
def test_two_rank_per_case_metrics_equal_one_rank_exactly(tmp_path):
    from tests.conftest import clean_env, communicate_all, free_port

    # the two ranks started with the variables torchrun gives its workers (env:// rendezvous), without
    # torchrun itself: what is checked here is the evaluator's reduction, not the launcher
    port, procs = free_port(), []
    for r in range(2):
        env = clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(tmp_path)], cwd=ROOT,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = [err for _, err in communicate_all(procs, timeout=180)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errs)
    one = _evaluate(_eval_cases(), batch=3)
    for r in (0, 1):
        two = {k: float(v) for k, v in json.loads((tmp_path / f"rank{r}.json").read_text()).items()}
        assert two.keys() == one.keys()
        for k in one:
            if k == "val_loss":  # float32 batch losses summed: equal up to rounding, not bit for bit
                assert two[k] == pytest.approx(one[k], rel=1e-6)
            else:
                assert repr(two[k]) == repr(one[k]), k


if __name__ == "__main__":
    _rank_worker(Path(sys.argv[1]))
