"""``train.augment_rng: sample``: each sample's augmentation drawn from (seed, epoch, dataset index), the
same whatever batch, rank or world size it lands in. The hash against SplitMix64's published outputs,
the batched ops on a batch against the same ops on its parts, and the real loaders of 1 rank x batch 4
against 2 ranks x batch 2."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastvision.data.augment import keyed
from fastvision.data.augment.spatial import build_augment

# nnU-Net's training augmentation as `configure --trainer nnunet` writes it, every op likely to fire
NNUNET_OPS = {
    "crop": {"size": [12, 12, 12], "pos": 1, "neg": 1},
    "flip": {"prob": 0.5, "axes": [0, 1, 2]},
    "affine": {"prob": 0.7, "degrees": 30, "scale": [0.7, 1.4], "rotate_prob": 0.6, "zoom_prob": 0.6,
               "sampling_scale": True},
    "noise": {"prob": 0.5, "std": 0.1},
    "blur": {"prob": 0.5, "sigma": [0.5, 1.0], "channel_prob": 0.5},
    "brightness": {"prob": 0.5},
    "contrast": {"prob": 0.5},
    "lowres": {"prob": 0.5, "range": [0.5, 1.0], "channel_prob": 0.5},
    "gamma_inverted": {"prob": 0.3, "range": [0.7, 1.5], "per_channel": True, "retain_stats": True},
    "gamma": {"prob": 0.5, "range": [0.7, 1.5], "per_channel": True, "retain_stats": True},
}


def test_splitmix64_is_the_published_generator():
    """Vigna's SplitMix64 seeded 0: its first three outputs (the finaliser of 0, g and 2g)."""
    g = 0x9E3779B97F4A7C15
    assert [keyed.splitmix64(k * g % 2**64) for k in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


class SplitMix64:
    """Vigna's generator as published, run step by step: state += golden, output the mix of the state."""

    def __init__(self, seed: int):
        self.state = seed

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) % 2**64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)


def test_uniform_is_output_n_of_the_samples_own_splitmix64_stream():
    """Draw ``call`` element ``e`` of a sample is output ``call * 2**24 + e + 1`` of SplitMix64 seeded with its
    key, checked against the generator run step by step (draw 0: the stream's first outputs)."""
    keys = np.array([keyed.sample_key(7, 2, i) for i in (0, 5, 2**40)], dtype=np.uint64)
    u = keyed.uniform(keys, call=0, n=4)
    for b, k in enumerate(keys.tolist()):
        g = SplitMix64(k)
        assert u[b].tolist() == [(g.next() >> 40) / 2**24 for _ in range(4)]  # exact: 24 bits in a float32
    later = keyed.uniform(keys[:1], call=1, n=2)[0].tolist()
    g = SplitMix64(int(keys[0]))
    g.state = (g.state + 2**24 * 0x9E3779B97F4A7C15) % 2**64  # skip outputs 1 .. 2**24 (draw 0)
    assert later == [(g.next() >> 40) / 2**24, (g.next() >> 40) / 2**24]
    u = keyed.uniform(keys, call=3, n=4)
    assert u.dtype == np.float32 and keyed.uniform(keys[1:2], 3, 4)[0].tolist() == u[1].tolist()
    many = keyed.uniform(np.arange(1000, dtype=np.uint64), 1, 50)
    assert 0.0 <= many.min() and many.max() < 1.0 and abs(many.mean() - 0.5) < 0.005


def test_sample_keys_differ_by_seed_epoch_index_and_patch():
    keys = {keyed.sample_key(s, e, i, p) for s in range(3) for e in range(3) for i in range(20) for p in range(2)}
    assert len(keys) == 3 * 3 * 20 * 2 and all(0 <= k < 2**63 for k in keys)


def _volumes(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(n, 2, 16, 16, 16, generator=g)
    label = (torch.rand(n, 16, 16, 16, generator=g) > 0.8).long()
    return image, label


@pytest.mark.parametrize("parts", [[[0, 1, 2], [3, 4, 5]], [[4, 1], [0, 5, 2, 3]], [[i] for i in range(6)]])
def test_a_sample_is_augmented_alike_in_any_batch(parts):
    """nnU-Net's ops on a batch of 6 with keys, against the same ops on the batch split into parts (as ranks
    would hold it): every sample's image and label equal, and unlike the per-rank generator's draws."""
    aug = build_augment(3, **NNUNET_OPS)
    image, label = _volumes(6)
    keys = torch.tensor([keyed.sample_key(0, 1, i) for i in range(6)])
    whole_i, whole_l = aug(image.clone(), label.clone(), None, keys=keys)
    for part in parts:
        idx = torch.tensor(part)
        got_i, got_l = aug(image[idx].clone(), label[idx].clone(), None, keys=keys[idx])
        torch.testing.assert_close(got_i, whole_i[idx], rtol=1e-5, atol=1e-5)
        assert torch.equal(got_l, whole_l[idx])
    # the same batch with one generator: the draws of sample i depend on the batch it is in
    rank_i, _ = aug(image[[3, 4, 5]].clone(), label[[3, 4, 5]].clone(), torch.Generator().manual_seed(0))
    rank_whole, _ = aug(image.clone(), label.clone(), torch.Generator().manual_seed(0))
    assert not torch.allclose(rank_i, rank_whole[3:])


def test_keys_change_the_draws_and_the_same_keys_repeat_them():
    aug = build_augment(3, **NNUNET_OPS)
    image, label = _volumes(3)
    k0 = torch.tensor([keyed.sample_key(0, 0, i) for i in range(3)])
    k1 = torch.tensor([keyed.sample_key(0, 1, i) for i in range(3)])  # the next epoch
    a, _ = aug(image.clone(), label.clone(), None, keys=k0)
    b, _ = aug(image.clone(), label.clone(), None, keys=k0)
    c, _ = aug(image.clone(), label.clone(), None, keys=k1)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def _augmented_epoch(run, sampler, batch: int, keys: bool = True) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every sample of an epoch through the run's loader path (keyed items, the task's collate, to_device,
    augment) with ``sampler``: sample key -> (image, label). ``keys=False``: the control, the same batches
    augmented with the rank's generator (seeded 0) instead of their keys."""
    from fastvision.data.augment.keyed import SAMPLE_KEY, KeyedItems
    from fastvision.engine.build import make_loader

    loader = make_loader(KeyedItems(run.train_set, run.cfg.train.seed), run.task, run.cfg, batch, True,
                         run.device, sampler=sampler)
    loader.set_epoch(1)
    out, gen = {}, torch.Generator().manual_seed(0)
    for b in loader:
        b = run.task.to_device(b, run.device)
        if keys:
            b = run.task.augment(b, None)
        else:
            b = {**run.task.augment({k: v for k, v in b.items() if k != SAMPLE_KEY}, gen), SAMPLE_KEY: b[SAMPLE_KEY]}
        assert b[SAMPLE_KEY].device.type == "cpu"
        for j, k in enumerate(b[SAMPLE_KEY].tolist()):
            out[k] = (b["image"][j], b["label"][j])
    return out


def test_one_rank_of_batch_4_and_two_ranks_of_batch_2_augment_the_same_samples(tiny_microscopy):
    """The real loader path: the epoch's samples of one process at batch 4 are those of two ranks at batch 2
    (the sampler's world-size-independent order), each augmented alike."""
    from fastvision import config, engine
    from fastvision.distributed import TrainSampler

    cfg = config.load("unet2d-microscopy", [{"data": {"args": {"path": str(tiny_microscopy), "image_size": [32, 32]},
                                                      "num_workers": 0},
                                             "model": {"args": {"filters": [4, 8, 16]}},
                                             "train": {"device": "cpu", "augment_rng": "sample"}}])
    run = engine.build(cfg, train=True, loaders=False)
    assert run.task.augment_fn is not None  # the recipe's flips, rotations and intensity
    n = len(run.train_set)
    one = _augmented_epoch(run, TrainSampler(n, num_replicas=1, rank=0, seed=0, drop_last=True), 4)
    two = {}
    for r in range(2):
        two.update(_augmented_epoch(run, TrainSampler(n, num_replicas=2, rank=r, seed=0, drop_last=True), 2))
    assert len(one) == n // 4 * 4 and set(one) == set(two)
    for k, (image, label) in one.items():
        torch.testing.assert_close(two[k][0], image, rtol=1e-5, atol=1e-5)
        assert torch.equal(two[k][1], label)
    # the control: with one generator per rank the same samples are augmented otherwise
    one = _augmented_epoch(run, TrainSampler(n, num_replicas=1, rank=0, seed=0, drop_last=True), 4, keys=False)
    two = {}
    for r in range(2):
        two.update(_augmented_epoch(run, TrainSampler(n, num_replicas=2, rank=r, seed=0, drop_last=True), 2,
                                    keys=False))
    assert set(one) == set(two) and any(not torch.allclose(two[k][0], one[k][0]) for k in one)


@pytest.mark.parametrize("recipe,sets,needle", [
    ("ssd320-small-shapes", [], "the detection task's augmentation is not per-sample keyed"),
    ("unet2d-microscopy", ["data.cache=smart"], "data.cache: smart"),
    ("resnet18-imagefolder", ["task.args.mixup=0.2"], "MixUp (task.args.mixup 0.2)"),
])
def test_where_draws_cannot_follow_the_sample_it_is_one_line(recipe, sets, needle, tmp_path, capsys,
                                                             tiny_microscopy):
    """An unkeyed augmentation is refused at build, naming the key and the reason (exit 2)."""
    from fastvision.data.synth import coco, imagenet
    from tests.cli.input_checks import one_line_error, run_cli

    data = tiny_microscopy
    if recipe.startswith("ssd"):
        data = coco.synth(tmp_path / "d", train=4, val=2)
    elif recipe.startswith("resnet"):
        data = imagenet.synth(tmp_path / "d", classes=2, per_class=4, val_per_class=2, size=32)
    flags = [a for s in ["train.augment_rng=sample", *sets] for a in ("--set", s)]
    code, _, err = run_cli(capsys, "train", recipe, "--data", data, "--out", tmp_path / "run", "--device", "cpu",
                           "--epochs", "1", *flags)
    one_line_error(code, err, "train.augment_rng: sample", needle)


def test_data_echoing_gives_each_echo_its_own_keys():
    """``data.repeats: 2`` yields each batch twice: with keyed samples the second yield's keys are new (so it is
    augmented anew) and the same for a sample whatever batch it is in; a mid-epoch resume's first batch keeps the
    echo numbers it has left."""
    from fastvision.data.augment.keyed import SAMPLE_KEY, KeyedItems, echo_keys
    from fastvision.data.loader import build_loader, echoes

    class Items:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"image": torch.full((1, 2, 2), float(i))}

    loader = build_loader(KeyedItems(Items(), seed=0), batch_size=4, repeats=2, num_workers=0, drop_last=True)
    loader.set_epoch(0)
    got = [b[SAMPLE_KEY] for b in loader]
    assert len(got) == 4 and not torch.equal(got[0], got[1]) and torch.equal(got[1], echo_keys(got[0], 1))
    assert torch.equal(echo_keys(got[0][2:], 1), got[1][2:])  # per sample: any split of the batch
    assert torch.equal(echo_keys(got[0], 1), echo_keys(got[0], 1)) and not torch.equal(
        echo_keys(got[0], 1), echo_keys(got[0], 2))
    first = {SAMPLE_KEY: got[0]}
    assert [torch.equal(b[SAMPLE_KEY], got[1]) for b in echoes(first, 1, 2)] == [True]  # resumed after echo 0
