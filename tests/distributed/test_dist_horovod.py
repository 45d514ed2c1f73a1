"""Horovod backend of fastvision.distributed: actionable errors without it, real 2-rank jobs with it.

Horovod is optional (`make horovod` builds it into .venv); the tests that need it skip where it is
absent. With it, this file is also the worker: ``horovodrun --gloo -np 2 python tests/distributed/test_dist_horovod.py
OUT`` runs the collectives and two accumulated optimizer steps through the dist helpers and compares
the weights with plain autograd on the concatenated global batch in one process.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # also run as a worker script

from fastvision import distributed  # noqa: E402
from fastvision.errors import ConfigError  # noqa: E402
from tests.conftest import clean_env  # noqa: E402

try:
    import horovod.torch  # noqa: F401

    HAVE_HOROVOD = True
except ImportError:
    HAVE_HOROVOD = False
needs_horovod = pytest.mark.skipif(not HAVE_HOROVOD, reason="horovod not installed (make horovod)")


@pytest.mark.skipif(HAVE_HOROVOD, reason="horovod is installed")
def test_horovod_launch_without_horovod_is_actionable():
    with pytest.raises(ConfigError, match="make horovod.*ddp"):
        distributed.launch_local(2, ["-c", "pass"], backend="horovod")
    with pytest.raises(ConfigError, match="not installed"):
        distributed.init("cpu", backend="horovod")


def test_horovod_steps_are_identities_under_ddp():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert distributed.wrap_optimizer(opt, model, backward_passes_per_step=4) is opt
    before = [p.detach().clone() for p in model.parameters()]
    distributed.broadcast_state(model, opt)
    model(torch.ones(3, 2)).sum().backward()
    with distributed.synchronized(opt):
        opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))



@needs_horovod
@pytest.mark.dist
def test_horovod_two_ranks_match_plain_autograd(tmp_path):
    cmd = [*distributed.horovodrun_command(2), sys.executable, str(Path(__file__).resolve()), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, x in enumerate(res):
        assert (x["rank"], x["size"], x["launcher"]) == (r, 2, "horovod")
        assert x["sum"] == 3.0 and x["broadcast"] == "from-0" and x["gathered"] == ["r0", "r1"]
        assert x["shard"] == list(range(r, 16, 2))
    assert res[0]["max_rel"] <= 1e-6
    assert res[0]["weights"] == res[1]["weights"]


@needs_horovod
@pytest.mark.dist
def test_horovod_cli_training_matches_ddp(tmp_path, tiny_microscopy):
    """`fastvision train --nproc 2 --backend horovod` ends with DDP's weights (no BN, no augmentation)."""
    common = ["--data", str(tiny_microscopy), "--device", "cpu", "--epochs", "2", "--batch-size", "2",
              "--lr", "0.05", "--nproc", "2"]
    for s in ("data.args.image_size=[32,32]", "model.args.filters=[4,8,16]", "data.num_workers=0", "examples=0",
              "data.augment.flip=null", "data.augment.rot90=null", "model.name=unet2d", "model.args.norm=none"):
        common += ["--set", s]
    runs = {}
    for backend in ("ddp", "horovod"):
        out = tmp_path / backend
        proc = subprocess.run([sys.executable, "-m", "fastvision.cli", "train", "unet2d-microscopy", *common,
                               "--backend", backend, "--out", str(out)], cwd=ROOT, env=clean_env(),
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[backend] = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]
    rel = max(((runs["horovod"][k] - v).double().norm() / v.double().norm().clamp_min(1e-12)).item()
              for k, v in runs["ddp"].items())
    assert rel <= 1e-5


def _worker(out: Path) -> None:
    """One horovod rank: collectives, default sampler shard, two accumulated steps with clipping."""
    torch.set_num_threads(1)
    env, device = distributed.init("cpu", backend="horovod")
    r = distributed.rank()
    res = {"rank": env.rank, "size": env.world_size, "launcher": env.launcher}
    res["sum"] = distributed.all_reduce_sum(torch.tensor([float(r + 1)], dtype=torch.float64)).item()
    res["broadcast"] = distributed.broadcast_object("from-0" if r == 0 else "wrong")
    res["gathered"] = distributed.gather_objects(f"r{r}")
    res["shard"] = list(distributed.TrainSampler(16, shuffle=False))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g)
    torch.manual_seed(1 + r)  # different init per rank: broadcast_state must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = distributed.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                              backward_passes_per_step=2)
    distributed.broadcast_state(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    # step k, micro-batch m: rank r takes rows 4k + 2m + r of the 8-row global batch, 2 rows a micro-batch
    idx = list(distributed.TrainSampler(16, shuffle=False))
    for k in range(2):
        for m in range(2):
            rows = idx[4 * k + 2 * m: 4 * k + 2 * m + 2]
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / 2).backward()
        with distributed.synchronized(opt):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        opt.zero_grad()
        glob = list(range(8 * k, 8 * k + 8))
        torch.nn.functional.mse_loss(ref(x[glob]), y[glob]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    res["max_rel"] = max(((a - b).norm() / b.norm()).item()
                         for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    res["weights"] = [p.detach().tolist() for p in model.parameters()]
    (out / f"rank{r}.json").write_text(json.dumps(res))
    distributed.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
