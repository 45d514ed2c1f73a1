"""Engine behaviour end to end on tiny real data: resume equivalence, bf16 on CPU, targets,
checkpoint contents and safety, evaluate and predict."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

import fastvision
from fastvision import api
from fastvision.engine import checkpoint
from fastvision.errors import DataError
from tests.conftest import tiny_overrides


def _weights(run_dir):
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def test_resume_reproduces_uninterrupted_run(tiny_microscopy, tmp_path):
    straight = tmp_path / "straight"
    fastvision.train("unet2d-microscopy", out=str(straight), **tiny_overrides(tiny_microscopy, epochs=2))
    split = tmp_path / "split"
    fastvision.train("unet2d-microscopy", out=str(split), **tiny_overrides(tiny_microscopy, epochs=1))
    # the second half runs as a fresh process would: same recipe, 2 epochs, resume from the run dir
    fastvision.train("unet2d-microscopy", out=str(split), resume="auto", **tiny_overrides(tiny_microscopy, epochs=2))
    a, b = _weights(straight), _weights(split)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    hist_a = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    epochs = [r["data"]["iou"] for r in hist_a if r["step"] == [1]]
    hist_b = [json.loads(line) for line in open(split / "metrics.jsonl")]
    assert epochs == [r["data"]["iou"] for r in hist_b if r["step"] == [1]]


def test_run_dir_contents_and_events(tiny_microscopy, tmp_path):
    run = tmp_path / "run"
    summary = fastvision.train("unet2d-microscopy", out=str(run), **tiny_overrides(tiny_microscopy))
    for name in ("config.yaml", "metrics.jsonl", "curves.png", "summary.json", "checkpoints/last.pt",
                 "checkpoints/best.pt"):
        assert (run / name).is_file(), name
    assert len(list((run / "examples").glob("*_overlay.png"))) == 2
    events = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert events[0]["step"] == "PARAMETER"
    assert events[0]["data"]["environment"]["world_size"] == 1
    assert events[0]["data"]["config"]["model"]["args"]["filters"] == [4, 8, 16]
    steps = [e for e in events if isinstance(e["step"], list) and len(e["step"]) == 2]
    assert steps and {"loss", "lr", "images_per_s", "data_time_s", "compute_time_s"} <= steps[0]["data"].keys()
    assert [e["step"] for e in events if e["step"] in ([0], [1])] == [[0], [1]]
    assert events[-1]["step"] == [] and 0.0 <= summary["iou"] <= 1.0
    # the checkpoint is plain data: loads with weights_only and holds everything resume needs
    ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "config"} <= ckpt.keys()
    assert ckpt["epoch"] == 1 and ckpt["step"] == 2 * 3  # 13 train images // batch 4 = 3 steps


def test_tensorboard_event_files_hold_the_runs_metrics(tiny_microscopy, tmp_path):
    """``--tensorboard``: TensorBoard's own reader finds every step's loss and every epoch's validation
    metrics in the event file, equal to what metrics.jsonl logged."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "run"
    fastvision.train("unet2d-microscopy", out=str(run), tensorboard=True, **tiny_overrides(tiny_microscopy))
    events = [json.loads(line) for line in open(run / "metrics.jsonl")]
    acc = accumulator.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    steps = [e["data"]["loss"] for e in events if isinstance(e["step"], list) and len(e["step"]) == 2]
    assert [round(x.value, 5) for x in acc.Scalars("train/loss")] == [round(v, 5) for v in steps]
    epochs = [e["data"] for e in events if isinstance(e["step"], list) and len(e["step"]) == 1]
    for name in ("iou", "dice", "train_loss"):
        assert [round(x.value, 5) for x in acc.Scalars(f"epoch/{name}")] == [round(d[name], 5) for d in epochs]


def test_bf16_autocast_on_cpu_trains(tiny_microscopy, tmp_path):
    summary = fastvision.train("unet2d-microscopy", out=str(tmp_path / "bf16"),
                               **tiny_overrides(tiny_microscopy, amp="bf16"))
    assert np.isfinite(summary["train_loss"]) and np.isfinite(summary["val_loss"])


def test_target_stops_early_and_records_time(tiny_microscopy, tmp_path):
    summary = fastvision.train("unet2d-microscopy", out=str(tmp_path / "t"),
                               **tiny_overrides(tiny_microscopy, epochs=5, target="val_loss=1e9"))
    assert summary["target_reached"] is True and summary["target_epoch"] == 1
    assert summary["epochs"] == 1 and summary["time_to_target_s"] > 0


def test_gradient_accumulation_matches_big_batch(tiny_microscopy, tmp_path):
    """Batch 2 x 2 accumulation steps == batch 4 (instance norm: no batch statistics; SGD: Adam would
    amplify float rounding of near-zero gradients into sign flips)."""
    common = {"model.name": "unet2d", "model.args.norm": "instance", "epochs": 1, "optim.name": "sgd",
              "data.augment.flip": None, "data.augment.rot90": None}  # same images in both runs
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "a"), **tiny_overrides(tiny_microscopy, **common))
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "b"),
                     **tiny_overrides(tiny_microscopy, batch_size=2, **{"train.accum_steps": 2}, **common))
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_evaluate_reproduces_best_validation(tiny_microscopy, tmp_path):
    run = tmp_path / "run"
    fastvision.train("unet2d-microscopy", out=str(run), **tiny_overrides(tiny_microscopy))
    best = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    logged = [h for h in best["history"] if h["epoch"] == best["epoch"]][0]
    result = api.evaluate_path(run, device="cpu")
    assert result["iou"] == pytest.approx(logged["iou"], abs=1e-12)
    assert result["items"] == 3


def test_predict_writes_mask_at_input_size(tiny_microscopy, tmp_path):
    run = tmp_path / "run"
    fastvision.train("unet2d-microscopy", out=str(run), **tiny_overrides(tiny_microscopy, epochs=1))
    big = tmp_path / "in" / "big.png"
    big.parent.mkdir()
    Image.fromarray((np.random.default_rng(0).random((48, 40)) * 255).astype(np.uint8)).save(big)
    written = api.predict(run, [str(big.parent)], tmp_path / "pred", device="cpu")
    mask = np.asarray(Image.open(tmp_path / "pred" / "big_mask.png"))
    assert mask.shape == (48, 40) and set(np.unique(mask)) <= {0, 255}
    assert (tmp_path / "pred" / "big_overlay.png") in written


def test_existing_run_dir_is_never_overwritten(tiny_microscopy, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="already exists"):
        fastvision.train("unet2d-microscopy", out=str(run), **tiny_overrides(tiny_microscopy))
    assert (run / "notes.txt").read_text() == "keep me"


def test_a_failed_write_keeps_the_last_good_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    writer = checkpoint.BackgroundWriter()
    writer.write({"model": {"w": torch.ones(3)}}, [path])
    writer.write({"model": {"w": torch.zeros(3)}, "bad": lambda: 0}, [path])  # unpicklable: fails in the thread
    # pickling a local lambda: AttributeError or PicklingError, depending on the Python version
    with pytest.raises((AttributeError, pickle.PicklingError), match="pickle"):
        writer.join()
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temp file left behind


def test_best_is_a_link_of_last_and_survives_later_writes(tmp_path):
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    writer = checkpoint.BackgroundWriter()
    checkpoint.atomic_write(best, lambda f: torch.save({"model": {"w": torch.full((3,), 7.0)}}, f))  # an older best.pt
    writer.write({"model": {"w": torch.ones(3)}, "epoch": 1}, [last, best])  # improved: both files
    writer.join()
    assert last.stat().st_ino == best.stat().st_ino  # one file written, best.pt linked to it
    a, b = checkpoint.load(last), checkpoint.load(best)
    assert a["epoch"] == b["epoch"] == 1 and torch.equal(b["model"]["w"], torch.ones(3))
    writer.write({"model": {"w": torch.zeros(3)}, "epoch": 2}, [last])  # not improved: last.pt only
    writer.join()
    assert torch.equal(checkpoint.load(last)["model"]["w"], torch.zeros(3))
    assert checkpoint.load(best)["epoch"] == 1 and torch.equal(checkpoint.load(best)["model"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]  # no temp names left


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_checkpoint_with_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": _Payload()}, path)
    with pytest.raises(DataError, match="evil.pt") as e:
        checkpoint.load(path)
    # the reason names the object, not torch's advice to load the file unsafely
    assert "pickled Python objects (Unsupported global: GLOBAL print)" in str(e.value)
    assert "weights_only" not in str(e.value)


def test_a_truncated_checkpoint_is_named_so(tmp_path):
    path = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:1500])  # a copy cut short
    with pytest.raises(DataError, match=r"last.pt: not a loadable fastvision checkpoint \(a damaged or truncated"):
        checkpoint.load(path)


def test_a_file_that_is_no_torch_save_file_says_so(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(DataError, match=r"notes.json: not a loadable fastvision checkpoint \(not a file torch.save"):
        checkpoint.load(path)


def test_ema_weights_are_validated_saved_and_resumed(tiny_microscopy, tmp_path):
    """The EMA is updated once per optimizer step, is what evaluation loads, and continues on resume."""
    over = tiny_overrides(tiny_microscopy, epochs=1, **{"train.ema_decay": 0.5})
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "ema"), **over)
    ckpt = checkpoint.load(tmp_path / "ema" / "checkpoints" / "last.pt")
    assert int(ckpt["ema"]["n_averaged"]) == 3  # one update per optimizer step
    name = "encoders.0.0.conv.weight"
    assert not torch.equal(ckpt["eval_model"][name], ckpt["model"][name])
    run, _ = api.load_run(tmp_path / "ema", device="cpu")
    assert torch.equal(run.model.state_dict()[name], ckpt["eval_model"][name])
    summary = fastvision.train("unet2d-microscopy", out=str(tmp_path / "ema"), resume="auto",
                               **{**over, "epochs": 2})
    assert summary["epochs"] == 2
    assert int(checkpoint.load(tmp_path / "ema" / "checkpoints" / "last.pt")["ema"]["n_averaged"]) == 6


def test_predict_needs_only_the_checkpoint(tiny_microscopy, tmp_path):
    """Training data moved or deleted: predict rebuilds model and task from the checkpoint alone."""
    import shutil

    data = shutil.copytree(tiny_microscopy, tmp_path / "data")
    fastvision.train("unet2d-microscopy", out=str(tmp_path / "run"), **tiny_overrides(data, epochs=1))
    image = tmp_path / "one.png"
    shutil.copy(data / "images" / "img_0001.png", image)
    shutil.rmtree(data)
    written = api.predict(tmp_path / "run", [str(image)], tmp_path / "pred", device="cpu")
    assert (tmp_path / "pred" / "one_mask.png") in written
    with pytest.raises(DataError, match=str(data)):  # evaluation does need the data, and says which
        api.evaluate_path(tmp_path / "run", device="cpu")


def test_curves_png_is_replaced_whole(tmp_path, monkeypatch):
    """``curves.png`` is written atomically: a drawing that fails part way (a kill, a full disk) leaves the
    curves of the epoch before, no half-written PNG or temp file (it was written in place)."""
    import matplotlib.figure
    from PIL import Image

    from fastvision.engine.log import RunLogger

    logger = RunLogger(tmp_path, progress=False)
    logger.history = [{"epoch": 0, "train_loss": 1.0, "iou": 0.2}]
    path = logger.plot_curves("iou")
    before = path.read_bytes()
    logger.history.append({"epoch": 1, "train_loss": 0.8, "iou": 0.3})

    def half(self, f, *a, **k):
        f.write(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half)
    with pytest.raises(OSError):
        logger.plot_curves("iou")
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    with Image.open(path) as im:
        assert im.format == "PNG"
    logger.close()


def test_epoch_line_is_one_line_when_piped(tmp_path, capsys):
    """The epoch line stays one line in piped (80-column) output: rich wrapped it, splitting a key from its
    value (``dice`` at the end of one line, ``0.91`` at the start of the next), so grepping the log missed it."""
    from fastvision.engine.log import RunLogger

    logger = RunLogger(tmp_path, progress=False)
    values = {"train_loss": 0.8049, "lr": 0.2, "images_per_s": 1.83, "epoch_time_s": 3.279, "dice": 0.9125,
              "dice_pooled": 0.9, "iou": 0.84, "iou_pooled": 0.83, "val_loss": 0.6224}
    logger.epoch_end(0, values)
    logger.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and "dice 0.9125" in lines[0] and lines[0].startswith("epoch 0")
