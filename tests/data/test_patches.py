"""nnU-Net's patch sampling (``data.args.oversample: batch_tail``, ``placement: nnunet``) against hand-worked
cases of ``nnUNetDataLoader`` (``_oversample_last_XX_percent``, ``get_bbox``), and the batch position's
path from the sampler's order through the cache to the crop, resumed mid-epoch."""
from __future__ import annotations

import pytest
import torch

from fastvision.data.cache.datasets import Pipeline
from fastvision.data.formats.patches import RandPatch, forced_foreground, nnunet_patch
from fastvision.data.loader import ThreadLoader
from fastvision.data.transforms import SLOT_KEY, RandomTransform, batch_slots
from fastvision.errors import ConfigError


@pytest.mark.parametrize("batch, forced", [(1, []), (2, [1]), (3, [2]), (4, [3]), (6, [4, 5]), (12, [8, 9, 10, 11])])
def test_last_items_of_a_batch_are_forced(batch, forced):
    # not sample_idx < round(B * 0.67): B=2 -> round(1.34)=1 (nnU-Net's "batch 2: 1 random, 1 oversampled"),
    # B=6 -> round(4.02)=4, B=12 -> round(8.04)=8
    assert [j for j in range(batch) if forced_foreground((j, batch), 0.33)] == forced


def test_nnunet_patch_centres_the_voxel_and_pads_past_the_volume():
    image = torch.arange(1000, dtype=torch.float32).reshape(1, 10, 10, 10) + 1
    label = torch.zeros(10, 10, 10, dtype=torch.uint8)
    label[9, 9, 8] = 2  # start = voxel - 6 // 2 = (6, 6, 5): past the upper faces, never pulled back inside
    im, lab = nnunet_patch(image, label, (6, 6, 6), True, torch.Generator().manual_seed(0))
    assert lab[3, 3, 3] == 2 and int(lab.sum()) == 2
    assert im[0, 3, 3, 3] == image[0, 9, 9, 8] and (im[0, 4:] == 0).all() and (im[0, :, :, 5] == 0).all()
    label[9, 9, 8], label[1, 2, 0] = 0, 1  # near the lower faces: held at -need_to_pad // 2 = 0
    _, lab = nnunet_patch(image, label, (6, 6, 6), True, torch.Generator().manual_seed(0))
    assert lab[1, 2, 0] == 1


def test_nnunet_patch_picks_a_class_then_a_voxel():
    """Each present class with probability 1/2, however many voxels it has (MONAI's pick: by voxel)."""
    label = torch.zeros(12, 12, 12, dtype=torch.uint8)
    label[:6, :6, :6] = 1  # 216 voxels
    label[10, 10, 10] = 2  # 1 voxel
    g = torch.Generator().manual_seed(1)
    hits = sum(int(nnunet_patch(torch.zeros(1, 12, 12, 12), label, (4, 4, 4), True, g)[1][2, 2, 2] == 2)
               for _ in range(400))
    assert 160 < hits < 240  # binomial(400, 0.5): +-4 sd


def test_nnunet_patch_random_box_and_small_volume():
    image, label = torch.ones(1, 4, 9, 9), torch.zeros(4, 9, 9, dtype=torch.uint8)
    g = torch.Generator().manual_seed(2)
    starts = set()
    for _ in range(60):
        im, _ = nnunet_patch(image, label, (6, 6, 6), False, g)
        # axis 0 is 2 short: need_to_pad 2, the box starts at -1 exactly (one zero slice either side)
        assert (im[0, 0] == 0).all() and (im[0, 5] == 0).all() and (im[0, 1:5] == 1).all()
        starts.add(int(im[0, 1].nonzero()[0, 0]) if im[0, 1].any() else -1)
    assert len(starts) == 1  # axes 1 and 2 (9 voxels) are never padded: every box lies inside


def test_bad_patch_rule_names_the_key():
    with pytest.raises(ConfigError, match=r"data\.args\.oversample"):
        RandPatch((4, 4, 4), 0.33, oversample="last")
    with pytest.raises(ConfigError, match=r"data\.args\.placement"):
        RandPatch((4, 4, 4), 0.33, placement="center")
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"data\.args\.pos_fraction"):
            RandPatch((4, 4, 4), bad)


class _Record(RandomTransform):
    """A suffix transform that asks for the batch slot and records it (the crop's contract)."""

    batch_slot = True

    def __call__(self, item, generator):
        item = dict(item)
        slot = item.pop(SLOT_KEY, None)
        return {**item, "slot": -1 if slot is None else slot[0]}


def _epoch(loader, epoch, start=0):
    loader.set_epoch(epoch, start)
    return [(int(i), int(s)) for b in loader for i, s in zip(b["i"], b["slot"], strict=True)]


def test_slots_follow_the_sampler_order_and_resume():
    data = Pipeline([{"i": torch.tensor(i)} for i in range(10)], [_Record()])
    loader = ThreadLoader(data, batch_size=3, shuffle=True, seed=4, num_workers=2, drop_last=True)
    full = _epoch(loader, 1)
    assert [s for _, s in full] == [0, 1, 2] * 3  # the position in each batch, whatever the index
    assert [i for i, _ in full] != sorted(i for i, _ in full)  # shuffled: slots are not the index
    assert _epoch(loader, 1, start=3) == full[3:]  # a resumed epoch gives every item the same slot
    assert batch_slots([5, 2, 5, 7], 2) == {5: (0, 2), 2: (1, 2), 7: (1, 2)}
    assert data[4]["slot"] == data.slot(4)[0]  # read outside the loader: the epoch's slot too


def test_crop_without_a_loader_falls_back_to_the_probability():
    label = torch.zeros(8, 8, 8, dtype=torch.uint8)
    label[5, 4, 3] = 1
    item = {"image": torch.zeros(1, 8, 8, 8), "label": label}
    always = RandPatch((4, 4, 4), 1.0, oversample="batch_tail", placement="nnunet")
    out = always(item, torch.Generator().manual_seed(0))  # no slot: the probability (1.0) decides
    assert out["label"][2, 2, 2] == 1 and out["label"].dtype == torch.long and SLOT_KEY not in out
    crop = RandPatch((4, 4, 4), 0.33, oversample="batch_tail", placement="nnunet")
    for seed in range(5):  # slot 1 of 2 is forced whatever the draw
        out = crop({**item, SLOT_KEY: (1, 2)}, torch.Generator().manual_seed(seed))
        assert out["label"][2, 2, 2] == 1 and SLOT_KEY not in out


def test_nnunet_patch_final_size_widens_the_random_box():
    """An initial patch of 12 for a final 8 in a 20-voxel axis: need_to_pad = 12 - 8 = 4, the box starts
    uniformly in [-2, 20 + 2 - 12] = [-2, 10] (get_bbox's lbs, ubs); without final_size in [0, 8]."""
    image = (torch.arange(20).reshape(1, 20, 1, 1) + 1).float().expand(1, 20, 12, 12).contiguous()
    label = torch.zeros(20, 12, 12, dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)

    def starts(final):
        out = set()
        for _ in range(300):
            im, _ = nnunet_patch(image, label, (12, 12, 12), False, g, final)
            col = im[0, :, 0, 0]
            first = int(col.nonzero()[0, 0])
            out.add(int(col[first]) - 1 - first)  # the box's start: volume index minus patch index
        return out

    assert starts((8, 12, 12)) == set(range(-2, 11)) and starts(None) == set(range(0, 9))
