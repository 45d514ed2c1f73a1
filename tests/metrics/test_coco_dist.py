"""COCO evaluation under DDP: 2 gloo ranks each score half the validation images; the gathered
metrics equal the single-process metrics exactly.

Each rank is a real process started as torchrun starts its workers (``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``, env:// rendezvous: ``tests.conftest.run_gloo_ranks``) running this
file's ``_worker``; the launcher itself (``distributed.launch_local``, the code path of ``--nproc``)
is tested in tests/distributed/test_dist.py, and here would only add a process importing torch.
Each rank shards the set with the engine's ``EvalSampler`` and reduces the evaluator the way
``engine.evaluate`` does (``state()`` on every rank, one all-reduce, ``load_state``, ``compute``).
Detections are noisy ground truth, seeded per image id, so both runs see identical detections
whichever rank produces them, and the mAP is well inside (0, 1).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # also imported by the ranks (CHILD)

from fastvision import distributed  # noqa: E402
from fastvision.data.formats.coco import build, collate_detection  # noqa: E402
from fastvision.metrics.coco import (  # noqa: E402
    METRIC_NAMES,
    COCOEvaluator,
    ground_truth_as_detections,
)

S = 128  # network input side
NUM_VAL = 13  # odd: the two shards differ in length
MAX_BOXES = 16  # more than any synthetic image holds


def noisy_detections(batch: dict) -> dict:
    """Jittered true boxes, some wrong classes, random scores, 2 false positives; seeded per image."""
    gt = ground_truth_as_detections(batch)
    M = gt["labels"].shape[1]  # the batch's padding: draws are made for MAX_BOXES so they do not depend on it
    boxes, scores, labels = [], [], []
    for b, image_id in enumerate(batch["image_id"].tolist()):
        g = torch.Generator().manual_seed(image_id)
        box = gt["boxes"][b] + torch.randn(MAX_BOXES, 4, generator=g)[:M] * 3
        flip = torch.rand(MAX_BOXES, generator=g)[:M] < 0.2
        lab = torch.where(flip, (gt["labels"][b] + 1) % 4, gt["labels"][b]).masked_fill(gt["labels"][b] < 0, -1)
        xy = torch.rand(2, 2, generator=g) * S * 0.7
        boxes.append(torch.cat([box, torch.cat([xy, xy + 24], 1)]))
        scores.append(torch.cat([torch.rand(MAX_BOXES, generator=g)[:M], torch.rand(2, generator=g)]))
        labels.append(torch.cat([lab, torch.randint(0, 4, (2,), generator=g)]))
    return {"boxes": torch.stack(boxes), "scores": torch.stack(scores), "labels": torch.stack(labels)}


def evaluate_shard(root: Path, results_path: Path | None) -> dict[str, float]:
    """This rank's shard through a ``COCOEvaluator``, reduced as ``engine.evaluate`` does."""
    splits = build(path=str(root), image_size=S)
    ev = COCOEvaluator(splits.info["val_ann_file"], splits.info["cat_ids"], (S, S), results_path=results_path)
    loader = torch.utils.data.DataLoader(splits.val, batch_size=4, sampler=distributed.EvalSampler(splits.val),
                                         collate_fn=collate_detection)
    for batch in loader:
        ev.update(noisy_detections(batch), batch)
    local = len(ev.detections)
    ev.load_state(distributed.all_reduce_sum(ev.state()))
    return {**ev.compute(), "local_images": float(local), "reduced_images": float(ev.sums.item())}



@pytest.mark.dist
def test_two_rank_coco_map_equals_single_process(tmp_path):
    from fastvision.data.synth.coco import synth

    root = synth(tmp_path / "shapes", seed=2, train=1, val=NUM_VAL)
    single = evaluate_shard(root, tmp_path / "single.json")
    assert single["images"] == NUM_VAL and 0.1 < single["map"] < 0.9

    from tests.conftest import run_gloo_ranks

    ranks = run_gloo_ranks(tmp_path, CHILD, [str(root)])  # asserts both ranks exit 0
    # each rank evaluated only its half, yet both report the whole set's metrics
    assert [r["local_images"] for r in ranks] == [NUM_VAL // 2, NUM_VAL - NUM_VAL // 2]
    for r in ranks:
        assert r["images"] == NUM_VAL and r["reduced_images"] == NUM_VAL
        for key in METRIC_NAMES:
            assert r[key] == single[key], key  # exact: the same detections reach COCOeval
    # the main rank's results JSON is the single-process one
    assert json.loads((tmp_path / "ddp.json").read_text()) == json.loads((tmp_path / "single.json").read_text())
    assert not (tmp_path / "ddp.json.tmp").exists()


CHILD = """import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from tests.metrics.test_coco_dist import _worker
_worker(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def _worker(root: Path, out: Path) -> None:
    """One rank: its metrics to ``out`` (JSON), the main rank's results JSON to ``ddp.json`` beside it."""
    torch.set_num_threads(1)
    env, _ = distributed.init("cpu", timeout_s=60)
    assert env.world_size == 2
    metrics = evaluate_shard(root, out.parent / "ddp.json")
    out.write_text(json.dumps(metrics))
    distributed.shutdown()
