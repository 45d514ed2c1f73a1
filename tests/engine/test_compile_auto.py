"""``train.compile: auto``: a real compile failure (no C++ compiler for Inductor) falls back to eager
with one line and the run trains on; slower compiled steps fall back too."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fastvision.engine.runtime import AutoCompile, maybe_compile
from tests.conftest import ROOT, clean_env


@pytest.mark.slow
def test_train_compile_auto_falls_back_to_eager_on_a_forced_compile_error(tiny_microscopy, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fastvision.cli", "train", "unet2d-microscopy", "--data", str(tiny_microscopy),
           "--out", str(out), "--epochs", "1", "--batch-size", "4", "--device", "cpu",
           "--set", "data.args.image_size=[32,32]", "--set", "data.num_workers=0", "--set", "examples=0",
           # the test model probe (BatchNorm + a 1x1 conv): the least to trace and lower before Inductor's
           # C++ step fails, the same failure and fallback as a U-Net's
           "--set", "model.name=probe", "--set", "train.compile=auto"]
    # Inductor finds no C++ compiler: a real compile error; a fresh kernel cache so nothing is reused
    env = clean_env(CXX="/nonexistent/g++", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if "train.compile auto" in line]
    assert len(lines) == 1 and "eager (compile failed:" in lines[0] and "C++ compiler" in lines[0], res.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["epochs"] == 1


def test_auto_compile_sees_through_to_the_model_and_falls_back_when_compiled_steps_are_slower():
    model = torch.nn.Linear(3, 2)
    auto = maybe_compile(model, "auto")
    assert isinstance(auto, AutoCompile)
    assert list(auto.parameters()) == list(model.parameters())  # clip_grad_norm_ and the optimizer see them
    assert [k.replace("_orig_mod.", "") for k in auto.state_dict()] == list(model.state_dict())
    auto._starts = [0.0, 0.3, 0.6, 0.9, 1.0, 1.1, 1.2]  # 3 compiled steps of 300 ms, then 3 eager of 100 ms
    auto._decide()
    assert auto.choice == "eager" and "slower (300.0 ms vs eager 100.0 ms)" in auto.reason
    x = torch.randn(4, 3)
    assert torch.equal(auto(x), model(x))  # eager from now on: the model itself


def test_the_fallback_line_reaches_past_an_error_that_only_introduces_its_cause():
    """torch < 2.5's BackendCompilerFailed says ``backend='inductor' raised:`` and keeps the reason in
    ``inner_exception``: the line names both; an ordinary error gives its own first line."""
    from fastvision.errors import error_line

    class BackendCompilerFailed(Exception):
        def __init__(self, inner):
            super().__init__("backend='inductor' raised:\nInvalidCxxCompiler: No working C++ compiler found")
            self.inner_exception = inner

    wrapped = BackendCompilerFailed(RuntimeError("No working C++ compiler found in torch._inductor.config.cpp.cxx"))
    assert error_line(wrapped) == ("BackendCompilerFailed: backend='inductor' raised: RuntimeError: "
                                    "No working C++ compiler found in torch._inductor.config.cpp.cxx")
    assert error_line(ValueError("bad shape\nmore")) == "ValueError: bad shape"


def test_a_later_compile_that_fails_falls_back_to_eager_and_the_step_goes_on(caplog):
    """Once compiled, a recompile (here for a new batch size) whose backend raises: that call and the ones
    after it run eagerly, with one line naming the failure; before it, the compiled graph ran."""
    graphs = []

    def first_only(gm, example_inputs):  # a real dynamo backend: the first graph runs, the second fails
        graphs.append(gm)
        if len(graphs) > 1:
            raise RuntimeError("cannot compile this shape")
        return gm.forward

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    auto = AutoCompile(model, trial=1, backend=first_only)
    auto.choice = "compiled"  # as after a decision for it
    x4, x5 = torch.randn(4, 3), torch.randn(5, 3)
    assert torch.allclose(auto(x4), model(x4)) and len(graphs) == 1 and auto.choice == "compiled"
    with caplog.at_level("WARNING", logger="fastvision.engine.runtime"):
        assert torch.allclose(auto(x5), model(x5))
    assert len(graphs) == 2 and auto.choice == "eager" and "cannot compile this shape" in auto.reason
    assert [r.getMessage() for r in caplog.records if "train.compile auto" in r.getMessage()] == [
        f"train.compile auto: eager ({auto.reason})"]
    auto(x5)
    assert len(graphs) == 2  # eager from now on: no further compile
