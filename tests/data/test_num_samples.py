"""``data.args.num_samples``: k crops of one cached volume per item (MONAI's ``num_samples``), drawn
from the item's own generator, flattened by the segmentation collate into B * k rows."""
from __future__ import annotations

import pytest
import torch

from fastvision.data.cache.select import wrap_train_set
from fastvision.data.formats.decathlon import MultiPatch, VolumeDataset
from fastvision.data.formats.patches import RandPatch
from fastvision.data.loader import ThreadLoader
from fastvision.data.preprocess3d import PreprocessParams
from fastvision.data.transforms import SAMPLES_KEY, SLOT_KEY, RandomTransform, item_generator
from fastvision.errors import ConfigError
from fastvision.losses import DiceLoss
from fastvision.tasks.segment import SegmentationTask

CASES = [{"id": f"c{i}", "image": [str(i)], "label": None} for i in range(4)]


def _volume(case, params):
    """A made-up preprocessed case (no files): random intensities, a small foreground box."""
    i = int(case["image"][0])
    image = torch.rand(1, 12, 12, 10, generator=torch.Generator().manual_seed(i))
    label = torch.zeros(12, 12, 10, dtype=torch.long)
    label[2 + i:5 + i, 3:6, 2:4] = 1
    return {"image": image, "label": label}


def _dataset(k, **kw):
    return VolumeDataset(CASES, PreprocessParams(intensity="none"), patch_size=(4, 4, 4), num_samples=k,
                         compute=_volume, **kw)


def test_k_crops_per_item_are_the_item_generators_next_draws():
    """Crop j of an item is the j-th RandPatch draw from the generator of (seed, epoch, index): the
    same first crop as with k = 1, and the same crops from every cache and on every read."""
    k, seed = 3, 5
    one, many = (wrap_train_set(_dataset(n), cache="ram", seed=seed) for n in (1, k))
    plain = wrap_train_set(_dataset(k), cache="none", seed=seed)
    crop = RandPatch((4, 4, 4), 0.5)
    for epoch in (0, 2):
        for ds in (one, many, plain):
            ds.set_epoch(epoch)
        for i in range(len(CASES)):
            patches = many[i][SAMPLES_KEY]
            assert len(patches) == k and set(many[i]) == {SAMPLES_KEY}
            vol = _volume(CASES[i], None)
            g = item_generator(seed, epoch, i)
            ref = [crop({**vol, "label": vol["label"].to(torch.uint8), "id": f"c{i}"}, g) for _ in range(k)]
            for p, r, again, other in zip(patches, ref, many[i][SAMPLES_KEY], plain[i][SAMPLES_KEY], strict=True):
                assert p["image"].shape == (1, 4, 4, 4) and p["label"].shape == (4, 4, 4) and p["id"] == f"c{i}"
                for key in ("image", "label"):
                    assert torch.equal(p[key], r[key]) and torch.equal(p[key], again[key])
                    assert torch.equal(p[key], other[key])
            assert torch.equal(one[i]["image"], patches[0]["image"])  # k = 1 is the first draw
            assert not all(torch.equal(patches[0]["image"], p["image"]) for p in patches[1:])


def test_collated_batch_is_b_times_k_patches_in_item_order():
    task = SegmentationTask(num_classes=2, loss=DiceLoss(softmax=True))
    ds = wrap_train_set(_dataset(2), cache="ram", seed=1)
    ds.set_epoch(0)
    loader = ThreadLoader(ds, batch_size=3, seed=1, shuffle=True, collate_fn=task.collate, num_workers=1)
    loader.set_epoch(0)
    batches = list(loader)
    order = list(loader.sampler)
    assert [b["image"].shape for b in batches] == [(6, 1, 4, 4, 4), (2, 1, 4, 4, 4)]
    assert batches[0]["label"].shape == (6, 4, 4, 4) and batches[0]["label"].dtype == torch.long
    assert batches[0]["id"] == [f"c{order[p]}" for p in range(3) for _ in range(2)]
    for p in range(3):  # row p * k + j is crop j of the batch's p-th volume
        for j in range(2):
            assert torch.equal(batches[0]["image"][2 * p + j], ds[order[p]][SAMPLES_KEY][j]["image"])
    # k = 1: items as before, no nesting
    assert SAMPLES_KEY not in wrap_train_set(_dataset(1), cache="ram")[0]


class _Slots(RandomTransform):
    def __init__(self):
        self.seen, self.batch_slot = [], True

    def __call__(self, item, generator):
        self.seen.append(item.get(SLOT_KEY))
        return {k: v for k, v in item.items() if k != SLOT_KEY}


def test_batch_tail_positions_count_patches():
    """Volume p of a batch of B gives patches p * k + j of B * k: the last round(f * B * k) patches of the
    batch are the foreground ones, as with B * k single patches."""
    rec = _Slots()
    out = MultiPatch(rec, 3)({"image": 0, SLOT_KEY: (1, 2)}, torch.Generator())
    assert rec.seen == [(3, 6), (4, 6), (5, 6)] and len(out[SAMPLES_KEY]) == 3
    MultiPatch(rec, 2)({"image": 0}, torch.Generator())  # read outside a loader: no position
    assert rec.seen[-2:] == [None, None]
    # through the cache and the loader: B = 2, k = 2, pos_fraction 0.5 -> rows 2, 3 of each batch forced
    task = SegmentationTask(num_classes=2, loss=DiceLoss(softmax=True))
    ds = wrap_train_set(_dataset(2, pos_fraction=0.5, oversample="batch_tail"), cache="ram", seed=3)
    loader = ThreadLoader(ds, batch_size=2, seed=3, shuffle=True, collate_fn=task.collate, num_workers=1)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for b in loader:
            assert b["label"][2:].flatten(1).any(1).all()


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True, None])
def test_bad_num_samples_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"^data\.args\.num_samples must be an integer >= 1, got"):
        _dataset(bad)
    from fastvision.data.formats.decathlon import build_decathlon

    with pytest.raises(ConfigError, match=r"data\.args\.num_samples"):  # before the folder is read
        build_decathlon(path="/nonexistent", num_samples=bad)
