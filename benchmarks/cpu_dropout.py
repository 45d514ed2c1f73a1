"""fastvision's CPU dropout (``fastvision/models/dropout.py``) against ``nn.Dropout``: the op alone, forward and
backward, and the training step of the spleen recipe's network, built once with each and otherwise the same.

Each pair runs in interleaved rounds in one process, one thread unless ``OMP_NUM_THREADS`` says otherwise,
under ``train.cpu_heap: keep`` as ``train`` runs; the figures are medians of CPU time (``time.process_time``).
The step is the recipe's network (MONAI's residual U-Net, dropout 0.2 after every conv), its DiceCE loss and
SGD, at the widths and patch of ``benchmarks/spleen_levers.py`` (widths / 4, 32 x 32 x 16, batch 2) and at the
recipe's own widths on a 64^3 patch. It also runs the same network without dropout: the dropout's share.

Usage: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/cpu_dropout.py [--rounds 7] [--json FILE]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from fastvision.engine import runtime
from fastvision.losses import DiceCELoss
from fastvision.models import create_model
from fastvision.models.dropout import Dropout


def _stock(model: nn.Module) -> nn.Module:
    """``model`` with every fastvision Dropout swapped for ``nn.Dropout`` of the same p."""
    for name, child in model.named_children():
        if isinstance(child, Dropout):
            setattr(model, name, nn.Dropout(child.p))
        else:
            _stock(child)
    return model


def _clock(fn, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n


def op_pair(numel: int, rounds: int, n: int) -> dict:
    x = torch.randn(numel, requires_grad=True)
    g = torch.randn(numel)
    mods = {"nn.Dropout": nn.Dropout(0.2), "fastvision": Dropout(0.2)}
    for m in mods.values():  # warm-up: the first calls allocate
        for _ in range(3):
            m(x).backward(g)
    times = {k: [] for k in mods}
    for _ in range(rounds):
        for k, m in mods.items():
            times[k].append(_clock(lambda m=m: m(x).backward(g), n))
    return {k: statistics.median(v) for k, v in times.items()}


def step_pair(widths: list[int], patch: list[int], batch: int, rounds: int, n: int) -> dict:
    torch.manual_seed(0)
    nets = {"fastvision": create_model("unet3d-spleen", filters=widths, dropout=0.2)}
    nets["nn.Dropout"] = _stock(create_model("unet3d-spleen", filters=widths, dropout=0.2))
    nets["no dropout"] = create_model("unet3d-spleen", filters=widths, dropout=0.0)  # the dropout's share
    for k in ("nn.Dropout", "no dropout"):
        nets[k].load_state_dict(nets["fastvision"].state_dict())
    loss = DiceCELoss(include_background=False, softmax=True, squared_pred=True, batch=True, lambda_dice=0.5,
                      lambda_ce=0.5)  # the recipe's
    x = torch.randn(batch, 1, *patch)
    y = torch.randint(0, 2, (batch, 1, *patch))
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in nets.items()}

    def step(k: str) -> None:
        opts[k].zero_grad(set_to_none=True)
        loss(nets[k](x), y).backward()
        opts[k].step()

    for k in nets:
        nets[k].train()
        for _ in range(2):
            step(k)
    times = {k: [] for k in nets}
    for _ in range(rounds):
        for k in nets:
            times[k].append(_clock(lambda k=k: step(k), n))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    runtime.set_heap("keep")  # as `train` sets it (train.cpu_heap's default)
    out = {"threads": torch.get_num_threads(), "torch": torch.__version__, "rounds": a.rounds, "op": {}, "step": {}}
    for numel in (1 << 17, 1 << 20, 1 << 23):
        r = op_pair(numel, a.rounds, max(2, (1 << 24) // numel))
        out["op"][numel] = r
        print(f"dropout 0.2, {numel} elements, forward + backward: nn.Dropout {r['nn.Dropout'] * 1e3:.2f} ms, "
              f"fastvision {r['fastvision'] * 1e3:.2f} ms: {r['nn.Dropout'] / r['fastvision']:.2f}x")
    for widths, patch, n, rounds in (([8, 16, 32, 64, 128], [32, 32, 16], 10, 3 * a.rounds),
                                     ([32, 64, 128, 256, 512], [64, 64, 64], 1, a.rounds)):
        r = step_pair(widths, patch, 2, rounds, n)
        key = f"widths {widths[0]}-{widths[-1]}, patch {'x'.join(map(str, patch))}, batch 2"
        out["step"][key] = r
        print(f"training step, {key}: nn.Dropout {r['nn.Dropout'] * 1e3:.1f} ms, fastvision "
              f"{r['fastvision'] * 1e3:.1f} ms: {r['nn.Dropout'] / r['fastvision']:.3f}x; without dropout "
              f"{r['no dropout'] * 1e3:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
