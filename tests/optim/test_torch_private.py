"""The private torch API behind ``fastvision.optim.torch_private``, checked on the installed torch:
each accessor does what the step relies on, and a torch without it fails with one line naming it."""
from __future__ import annotations

import logging

import pytest
import torch

from fastvision.errors import FastvisionError
from fastvision.optim import torch_private


@pytest.mark.parametrize("version, ok", [("2.4.0", True), ("2.13.0+cpu", True), ("2.11.0+cu130", True),
                                         ("2.14.1+cu130", True),
                                         ("2.3.1", False), ("2.15.0", False), ("3.0.0a0", False)])
def test_version_window(version, ok):
    assert torch_private.check(version) is ok


def test_the_running_torch_is_inside_the_window():
    assert torch_private.check()


def test_out_of_window_warns_once(caplog, monkeypatch, fresh_logging):
    monkeypatch.setattr(torch_private, "_warned", [])
    with caplog.at_level(logging.WARNING, logger="fastvision.optim.torch_private"):
        torch_private.check("2.99.0")
        torch_private.check("2.99.0")
    assert sum("outside the versions" in r.getMessage() for r in caplog.records) == 1


def _params(grad: float) -> list[torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), grad)
    return [p]


@pytest.mark.parametrize("grad, found", [(1.0, 0.0), (float("inf"), 1.0), (float("nan"), 1.0)])
def test_scaler_found_inf_reads_the_scalers_unscale(grad, found):
    params = _params(grad)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale is made on first use
    scaler.unscale_(opt)
    assert float(torch_private.scaler_found_inf(scaler, opt)) == found
    if found == 0:
        assert torch.equal(params[0].grad, torch.full((4,), grad / 4))  # unscaled


def test_scaler_found_inf_without_unscale_names_the_internal():
    opt = torch.optim.SGD(_params(1.0), lr=0.1)
    with pytest.raises(FastvisionError, match="_per_optimizer_states"):
        torch_private.scaler_found_inf(torch.amp.GradScaler("cpu"), opt)


@pytest.mark.parametrize("found, changed", [(0.0, True), (1.0, False)])
def test_fused_skip_makes_a_fused_step_a_no_op_on_the_device(found, changed):
    params = _params(0.5)
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    with torch_private.fused_skip(opt, torch.tensor(found)):
        opt.step()
    assert not hasattr(opt, "found_inf")  # the attribute is gone after the step
    assert (not torch.equal(params[0].detach(), torch.ones(4))) is changed


def test_fused_skip_refuses_an_optimizer_without_fused_support():
    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    with pytest.raises(FastvisionError, match="_step_supports_amp_scaling"):
        with torch_private.fused_skip(Plain(_params(1.0)), torch.tensor(0.0)):
            pass


def test_non_finite_check_sets_the_flag_and_unscales():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    found = torch.zeros(())
    torch_private.non_finite_check_(grads, found, torch.tensor(0.5))
    assert float(found) == 1.0 and torch.equal(grads[0], torch.tensor([1.0, 2.0]))
