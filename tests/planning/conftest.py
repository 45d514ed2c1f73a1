"""The planning tests' shared fixtures: ``estimate.trace`` run once per distinct (config, batch, switches)."""
from __future__ import annotations

import pytest

_TRACES: dict = {}


@pytest.fixture
def trace_memo(monkeypatch):
    """``memo(store, drop=())`` replaces ``estimate.trace`` for the test by one that runs the real trace once per
    distinct (config without its ``drop`` sections, batch, switches) and keeps it in ``store``. A trace is a pure
    function of the config and its arguments (a fake-tensor step, 1-4 s of CPU for a recipe), StepTrace is never
    mutated, and every new key still runs the real trace."""
    from fastvision import config
    from fastvision.planning import estimate as est

    def memo(store: dict, drop: tuple[str, ...] = ()) -> None:
        real = est.trace

        def trace(cfg, batch, **kw):
            kept = {k: v for k, v in config.to_dict(cfg).items() if k not in drop}
            key = (repr(kept), batch, repr(sorted(kw.items())))
            if key not in store:
                store[key] = real(cfg, batch, **kw)
            return store[key]

        monkeypatch.setattr(est, "trace", trace)

    return memo


@pytest.fixture
def traced_once(trace_memo):
    """Plans trace the same recipe at the same batch many times (every calibration case, both GPUs of one
    test, configure's check of its own batch): each distinct trace runs once per process and is shared."""
    trace_memo(_TRACES)
