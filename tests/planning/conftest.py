"""The planning tests' shared fixture: ``estimate.trace`` run once per distinct (config, batch, switches)."""
from __future__ import annotations

import pytest

_TRACES: dict = {}


@pytest.fixture
def traced_once(monkeypatch):
    """``estimate.trace`` is a pure function of the config and its arguments (a fake-tensor step, 1-4 s of
    CPU for a recipe): plans trace the same recipe at the same batch many times (every calibration case,
    both GPUs of one test, configure's check of its own batch), so each distinct trace runs once per process
    and is shared. The real trace runs for every new (config, batch, switches); StepTrace is never mutated."""
    from fastvision import config
    from fastvision.planning import estimate as est

    real = est.trace

    def trace(cfg, batch, **kw):
        key = (repr(config.to_dict(cfg)), batch, repr(sorted(kw.items())))
        if key not in _TRACES:
            _TRACES[key] = real(cfg, batch, **kw)
        return _TRACES[key]

    monkeypatch.setattr(est, "trace", trace)
