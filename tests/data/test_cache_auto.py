"""``data.cache: auto``: the tier rule on hand-made memory figures, the cached bytes against a filled
cache's own, and through the engine's build: the tier chosen, logged, serving the sampler's items."""
from __future__ import annotations

import logging

import pytest

from fastvision.data.cache.auto import cached_bytes, choose
from tests.data.test_cache_parity import _expected, _served, _strip

pytestmark = pytest.mark.usefixtures("private_cache")
G = 2**30


@pytest.mark.parametrize("total, kw, tier", [
    # one GPU: 3 GiB of items fit in half of 10 GiB free on the device and in half of 64 GiB of RAM
    (3 * G, dict(device_type="cuda", world_size=1, local_world_size=1, ram_free=64 * G, gpu_free=10 * G), "gpu"),
    # 8 ranks: each device holds 1/8 (2 GiB of 16 GiB), the node's one host copy in /dev/shm
    (16 * G, dict(device_type="cuda", world_size=8, local_world_size=8, ram_free=64 * G, shm_free=40 * G,
                  gpu_free=4 * G), "gpu"),
    # the share is too large for the device: the node's shared copy instead
    (16 * G, dict(device_type="cuda", world_size=8, local_world_size=8, ram_free=64 * G, shm_free=40 * G,
                  gpu_free=3 * G), "shared"),
    # /dev/shm too small, but two copies fit in RAM
    (2 * G, dict(device_type="cpu", world_size=2, local_world_size=2, ram_free=10 * G, shm_free=1 * G), "ram"),
    (6 * G, dict(device_type="cpu", world_size=1, local_world_size=1, ram_free=10 * G), "none"),
    (5 * G, dict(device_type="cpu", world_size=1, local_world_size=1, ram_free=10 * G), "ram"),  # at half: fits
])
def test_the_tier_rule(total, kw, tier):
    assert choose(total, **kw)[0] == tier


def test_cached_bytes_are_what_a_filled_ram_cache_holds(spleen):
    from fastvision import engine
    from fastvision.data.cache.datasets import item_nbytes
    from tests.data.test_cache_parity import _cfg

    run = engine.build(_cfg(spleen, "ram"), train=True)
    held = sum(item_nbytes(x) for x in run.train_set.items)
    n = len(run.train_set.items)
    # the items are cases of different shapes: item 0's bytes times the items, against the filled cache
    assert n == len(run.train_set) and cached_bytes(run.train_set.base) > 0
    assert 0.5 * held <= cached_bytes(run.train_set.base) <= 2 * held


def test_auto_through_the_build_logs_its_tier_and_serves_the_samplers_items(spleen, caplog):
    with caplog.at_level(logging.INFO, logger="fastvision.data.cache.auto"):
        got = _served(spleen, "auto")
    line = [r.getMessage() for r in caplog.records if "data.cache auto:" in r.getMessage()]
    assert len(line) == 1 and line[0].startswith("data.cache auto: ram (") and "available RAM" in line[0]
    assert got["cache"] == "CacheDataset" and _strip(got["epochs"]) == _expected(spleen, 1, 0)
