"""The layout-keeping instance norm alone on a CPU, forward + backward: ``norm: instance_cl`` as built
(:class:`fastvision.models.instance_norm.InstanceNormCL`, its own backward, each statistic one sum over the
spatial axes) against the forms it replaced: the same function with each sum staged (the last spatial axes,
then the first: ``instance_cl`` on the evening of 2026-12-01, run here by swapping the module's
``_spatial_sum`` for :func:`staged_sum` while that row runs), ``var_mean`` + ``addcmul`` with autograd's
backward (until 2026-12-01), and the stock ``nn.InstanceNorm3d`` on NCDHW.

    python benchmarks/instance_norm_cpu.py [--rounds 7] [--reps 10] [--dtype fp32,bf16]
    python benchmarks/instance_norm_cpu.py --step [--rounds 7] [--reps 8]   # the CT network's step, staged vs one sum

Shapes: the CT recipe's (``configure --trainer nnunet`` on generated CT: batch 2, patch 24 x 32 x 32,
32-64-128-256) maps at each stage. The three take turns in ``--rounds`` interleaved rounds of ``--reps``
forward + backward passes each; the table gives the median per pass and the ratios.

``--step``: the CT plan's whole network (:data:`CT_NET`, NDHWC, deep supervision, batch 2 of 1 x 32 x 32 x 24),
forward under the precision's autocast and backward of the mean square of its outputs, with ``instance_cl``'s
staged sums against its one sum per statistic, in interleaved rounds (the network's step, not the loop: the
paired rounds of ``train_vs_nnunet.py`` time that).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fastvision.models import instance_norm  # noqa: E402
from fastvision.models.instance_norm import InstanceNormCL  # noqa: E402

# the network `configure --trainer nnunet` plans for train_vs_nnunet.py's generated CT (model.args)
CT_NET = dict(in_channels=1, out_channels=2, filters=[32, 64, 128, 256], strides=[[1, 1, 1], [2, 2, 2], [2, 2, 2],
              [2, 2, 1]], kernel_size=[[3, 3, 3]] * 4, n_convs=2, norm="instance_cl", act="leakyrelu", down="stride",
              up="transpose", deep_supervision=True, init="he_heads")
SHAPES = [(2, 32, 24, 32, 32), (2, 64, 12, 16, 16), (2, 128, 6, 8, 8), (2, 256, 3, 4, 4)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class VarMeanNorm(nn.Module):
    """The previous ``instance_cl`` (before 2026-12-01): ``var_mean`` statistics and one ``addcmul``,
    autograd's backward. The comparison row only."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(2, x.dim()))
        var, mean = torch.var_mean(x, dim=dims, keepdim=True, correction=0)
        shape = (1, -1) + (1,) * len(dims)
        scale = torch.rsqrt(var.float() + self.eps) * self.weight.view(shape)
        shift = self.bias.view(shape) - mean.float() * scale
        return torch.addcmul(shift.to(x.dtype), x, scale.to(x.dtype))


def staged_sum(x: torch.Tensor, dims: tuple[int, ...], square: bool = False) -> torch.Tensor:
    """The staged sums of the evening of 2026-12-01 (the comparison row only): over the last spatial axes
    (``vector_norm`` squared with ``square``), then over the first."""
    inner, acc = dims[1:] or dims, torch.promote_types(x.dtype, torch.float32)
    if square:
        part = torch.linalg.vector_norm(x, 2, inner, keepdim=True, dtype=acc).square_()
    else:
        part = x.sum(inner, keepdim=True, dtype=acc)
    return part if inner == dims else part.sum(dims[0], keepdim=True)


@contextlib.contextmanager
def staged():
    """``instance_norm._spatial_sum`` is :func:`staged_sum` inside."""
    kept = instance_norm._spatial_sum
    instance_norm._spatial_sum = staged_sum
    try:
        yield
    finally:
        instance_norm._spatial_sum = kept


def passes(norm: nn.Module, x: torch.Tensor, g: torch.Tensor, reps: int, old_sums: bool = False) -> float:
    with staged() if old_sums else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(reps):
            norm(x).backward(g)
        return (time.perf_counter() - t0) / reps


def step_rounds(rounds: int, reps: int, dtypes: list[str]) -> None:
    """--step: the CT network's forward + backward with the staged sums and with one sum, interleaved."""
    import fastvision.models  # noqa: F401  (registers the models)
    from fastvision.registry import MODELS

    torch.manual_seed(0)
    net = MODELS.get("unet3d")(**CT_NET).to(memory_format=torch.channels_last_3d)
    x = torch.randn(2, 1, 32, 32, 24).to(memory_format=torch.channels_last_3d)

    def timed(name: str, old: bool, n: int) -> float:
        with staged() if old else contextlib.nullcontext():
            t0 = time.perf_counter()
            for _ in range(n):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
                    out = net(x)
                sum(o.float().square().mean() for o in out).backward()
                net.zero_grad(set_to_none=True)
            return (time.perf_counter() - t0) / n * 1e3

    print("| precision | staged sums ms | one sum ms | one sum's speed (median of rounds' ratios, range) |")
    print("|---|---|---|---|")
    for name in dtypes:
        times: dict[bool, list[float]] = {True: [], False: []}
        timed(name, True, 2), timed(name, False, 2)  # warm-up
        for r in range(rounds):
            for old in ((False, True) if r % 2 == 0 else (True, False)):
                times[old].append(timed(name, old, reps))
        ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
        print(f"| {name} | {statistics.median(times[True]):.1f} | {statistics.median(times[False]):.1f} | "
              f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dtype", default="fp32,bf16")
    p.add_argument("--step", action="store_true", help="the CT network's step, staged sums vs one sum")
    a = p.parse_args(argv)
    unknown = [d for d in a.dtype.split(",") if d not in DTYPES]
    if unknown:
        p.error(f"--dtype {','.join(unknown)}: valid are {', '.join(DTYPES)}")
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; {a.rounds} rounds x {a.reps} passes")
    if a.step:
        step_rounds(a.rounds, a.reps, a.dtype.split(","))
        return 0
    print("| map (B, C, D, H, W) | dtype | stock, NCDHW ms | var_mean form, NDHWC ms | staged sums, NDHWC ms "
          "| instance_cl, NDHWC ms | instance_cl's speed: x staged | x var_mean form | x stock |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.dtype.split(","):
        dt = DTYPES[name]
        for shape in SHAPES:
            torch.manual_seed(0)
            x = (torch.randn(*shape) * 2 + 1).to(dt)
            g = torch.randn(*shape).to(dt)
            cl = {"x": x.contiguous(memory_format=torch.channels_last_3d).requires_grad_(),
                  "g": g.contiguous(memory_format=torch.channels_last_3d)}
            rows = {"stock": (nn.InstanceNorm3d(shape[1], affine=True).to(dt), x.clone().requires_grad_(), g),
                    "var_mean": (VarMeanNorm(shape[1]), cl["x"], cl["g"]),
                    "staged": (InstanceNormCL(shape[1]), cl["x"], cl["g"], True),
                    "instance_cl": (InstanceNormCL(shape[1]), cl["x"], cl["g"])}
            times = {k: [] for k in rows}
            for row in rows.values():
                passes(*row[:3], 2, *row[3:])  # warm-up
            for r in range(a.rounds):
                for k in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
                    times[k].append(passes(*rows[k][:3], a.reps, *rows[k][3:]))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            cl_ms = med["instance_cl"]
            print(f"| {' x '.join(map(str, shape))} | {name} | {med['stock']:.2f} | {med['var_mean']:.2f} | "
                  f"{med['staged']:.2f} | {cl_ms:.2f} | {med['staged'] / cl_ms:.2f}x | "
                  f"{med['var_mean'] / cl_ms:.2f}x | {med['stock'] / cl_ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
