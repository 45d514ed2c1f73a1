"""Re-running ``fastvision scale`` into the same ``--out``: the runs it finished with the same settings are
reused, its own interrupted runs are trained again, and anything else in the way needs ``--force``.

``OUT/scale-runs.json`` records the ``fastvision train`` command of every run the sweep started (written
before the run starts); a run is finished when its folder holds ``summary.json`` (written after its last
epoch), the rule of ``train --folds``.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from fastvision.errors import DataError
from fastvision.utils.files import atomic_write

log = logging.getLogger(__name__)

MANIFEST = "scale-runs.json"


def _manifest(out_dir: Path) -> dict[str, list[str]]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        raise DataError(f"{path}: not JSON; remove it, or pass --force to train every run again") from None
    return data if isinstance(data, dict) else {}


def prepare(out_dir: Path, run_dir: Path, cmd: list[str], force: bool) -> bool:
    """Whether ``run_dir`` already holds the finished run of ``cmd`` (the ``train`` arguments, no interpreter).
    Otherwise clear the way for it, and record ``cmd`` as started.

    Raises:
        DataError: ``run_dir`` holds something else (another setting's run, or not a sweep's) and not ``force``.
    """
    run_dir = Path(run_dir)
    ours = _manifest(out_dir).get(run_dir.name) == cmd
    if run_dir.exists() and not (run_dir.is_dir() and not any(run_dir.iterdir())):
        if ours and not force and (run_dir / "summary.json").is_file():
            log.info("scale: %s finished already with these settings, reused", run_dir)
            return True
        if not (ours or force):
            raise DataError(f"{run_dir}: holds a run of other settings (or not one of scale's); pass --force to "
                            "train it again, or choose another --out")
        log.info("scale: %s %s; training it again", run_dir, "replaced (--force)" if force else "was interrupted")
        shutil.rmtree(run_dir) if run_dir.is_dir() else run_dir.unlink()
    if not ours:
        record = {**_manifest(out_dir), run_dir.name: cmd}
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        data = (json.dumps(record, indent=2) + "\n").encode()
        atomic_write(Path(out_dir) / MANIFEST, lambda f: f.write(data))  # a kill never leaves half a manifest
    return False
