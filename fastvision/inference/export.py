"""Export a trained model to ONNX or TorchScript, checked against the PyTorch model.

``fastvision export CKPT --format onnx|torchscript`` rebuilds the bare model from the checkpoint's
saved config with the engine's :func:`~fastvision.engine.build` (no dataset needed), loads the
weights, and exports it with the input the task feeds the model (e.g. normalised float images for
classification), batch axis dynamic. The exported file is then run on a random input of another batch size -- ONNX with
onnxruntime when it is installed, TorchScript with ``torch.jit.load`` -- and the maximum absolute
difference to the PyTorch output is reported (the export fails the check above ``tolerance``).

ONNX uses the ``torch.export``-based exporter (PyTorch's default since 2.9), which needs the
``onnx`` and ``onnxscript`` packages. TorchScript uses ``torch.jit.trace`` (deprecated upstream,
still the format many C++ deployments load).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fastvision.errors import ConfigError, DataError
from fastvision.inference.export_checks import (  # noqa: F401  (check_opset: part of this module's API)
    SUFFIX,
    check_opset,
    check_out_format,
    not_the_checkpoint,
    written_opset_is,
)
from fastvision.tasks.base import Task
from fastvision.utils.files import term_exits

log = logging.getLogger(__name__)

FORMATS = ("onnx", "torchscript")
_ONNX_SINGLE_FILE_LIMIT = 1.5e9  # bytes of weights; protobuf files cannot exceed 2 GB


class _Captured(Exception):
    """Raised by the capture hook to stop the forward once the model's input is known."""

    def __init__(self, value: Tensor):
        self.value = value


def model_input(model: nn.Module, task: Task, batch_size: int = 2) -> Tensor:
    """The tensor the task feeds ``model`` for a synthetic CPU batch of ``batch_size``.

    The task may transform the batch first (classification normalises uint8/[0, 1] images),
    so the input is captured with a forward pre-hook rather than guessed.

    Returns:
        The model input, e.g. ``(B, C, H, W)`` or ``(B, C, D, H, W)`` float.
    """
    def hook(_module, args):
        raise _Captured(args[0])

    batch = task.synthetic_batch(batch_size, torch.device("cpu"))
    handle = model.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            task.forward(model, batch)
    except _Captured as c:
        return c.value.detach().contiguous()
    finally:
        handle.remove()
    raise ConfigError(f"task {type(task).__name__} never called the model in forward()")


def outputs(obj: Any) -> list[Tensor]:
    """Tensors of a model output (tensor, tuple/list, or dict in insertion order), flattened."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in outputs(o)]
    raise TypeError(f"cannot compare model output of type {type(obj).__name__}")


def output_names(obj: Any, prefix: str = "") -> list[str]:
    """ONNX names of a model output's tensors, in :func:`outputs`' order: a dict's keys (nested:
    ``key.sub``, ``key.0``), ``output`` for a lone tensor, ``output0`` ... for a tuple or list; a
    detector's ``cls_logits``, ``box_codes`` and ``anchors`` keep their names in the file."""
    if isinstance(obj, Tensor):
        return [prefix or "output"]
    if isinstance(obj, dict):
        return [n for k, v in obj.items() for n in output_names(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [n for i, v in enumerate(obj) for n in output_names(v, f"{prefix}.{i}" if prefix else f"output{i}")]
    raise TypeError(f"cannot name model output of type {type(obj).__name__}")


def export_model(model: nn.Module, example: Tensor, path: Path, fmt: str, opset: int | None = None) -> Path:
    """Write ``model`` (eval mode, on CPU) to ``path`` as ONNX or TorchScript.

    Args:
        model: the bare model.
        example: an input with batch size >= 2 (torch.export treats a size-1 axis as a constant).
        path: output file.
        fmt: "onnx" or "torchscript".
        opset: ONNX opset; None: the exporter's default (currently 18).

    Returns:
        ``path``.

    Raises:
        ConfigError: unknown format, or ONNX without the ``onnx`` / ``onnxscript`` packages.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if example.shape[0] < 2:
        raise ValueError("export needs an example batch of at least 2 so the batch axis stays dynamic")
    model.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "torchscript":
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.trace.* is deprecated")
            # the models' input-size checks read the traced sizes as Python values: the trace keeps them
            # as constants, which the round trip below checks at another batch size
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            traced = torch.jit.trace(model, example, strict=False)  # strict=False: dict outputs
        torch.jit.save(traced, str(path))
        return path
    _require_onnx()
    if "dynamic_shapes" not in inspect.signature(torch.onnx.export).parameters:  # torch < 2.5
        _export_onnx_torchscript(model, example, path, opset)
        return path
    with torch.no_grad():
        names = output_names(model(example))
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # torch's exporter warns that torchvision's detection ops are not registered where torchvision is not
    # installed (none of ours uses them), and torch's own pytree deprecation: neither is the user's to act on;
    # onnxscript's version converter logs a traceback where it cannot reach the opset asked for (the file then
    # keeps torch's opset: export_checkpoint says so in one line); onnx_ir warns that it leaves an output that is
    # a constant (SSD's anchors) out of its initializer deduplication, which is what it should do
    quiet = [logging.getLogger(n) for n in ("torch.onnx._internal.exporter._registration",
                                            "torch.onnx._internal.exporter._compat", "onnxscript.version_converter",
                                            "onnx_ir.passes.common.initializer_deduplication")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, message=r".*LeafSpec.*")
            torch.onnx.export(model, (example,), str(path), dynamo=True, input_names=["input"],
                              output_names=names, opset_version=opset,
                              dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
                              verbose=False, external_data=weight_bytes > _ONNX_SINGLE_FILE_LIMIT)
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return path


def _export_onnx_torchscript(model: nn.Module, example: Tensor, path: Path, opset: int | None) -> None:
    """torch < 2.5, whose ``torch.onnx.export`` has no ``dynamic_shapes``: its TorchScript exporter, the batch
    axis of the input and of every output dynamic (outputs named as :func:`output_names` names them)."""
    with torch.no_grad():
        outputs = output_names(model(example))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(model, (example,), str(path), input_names=["input"], output_names=outputs,
                          dynamic_axes={n: {0: "batch"} for n in ["input", *outputs]},
                          opset_version=opset or 17, verbose=False)


def _require_onnx() -> None:
    import importlib.util

    missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"ONNX export needs {' and '.join(missing)}: pip install onnx onnxscript onnxruntime")


def max_abs_diff(path: Path, fmt: str, model: nn.Module, x: Tensor) -> float | None:
    """Largest absolute difference between the exported file and ``model`` on input ``x``.

    Returns:
        The difference over every output tensor, or None for ONNX when onnxruntime is missing.
    """
    with torch.no_grad():
        expected = outputs(model.eval()(x))
    if fmt == "torchscript":
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.load.* is deprecated")
            got = outputs(torch.jit.load(str(path), map_location="cpu")(x))
    else:
        try:
            import onnxruntime
        except ImportError:
            return None
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        got = [torch.from_numpy(a) for a in session.run(None, {name: x.numpy()})]
    if len(got) != len(expected):
        raise RuntimeError(f"{path}: {len(got)} outputs, the PyTorch model gives {len(expected)}")
    return max(float((g.float() - e.float()).abs().max()) for g, e in zip(got, expected, strict=True))


def checkpoint_path(path: Path) -> Path:
    """A checkpoint file, or a run directory's ``checkpoints/best.pt`` (else ``last.pt``)."""
    if path.is_dir():
        for p in (path / "checkpoints" / "best.pt", path / "checkpoints" / "last.pt"):
            if p.is_file():
                return p
        raise DataError(f"{path}: no checkpoints/best.pt or checkpoints/last.pt")
    if not path.is_file():
        raise DataError(f"{path}: checkpoint not found")
    return path


def load_model(path: Path) -> tuple[nn.Module, Task, Path]:
    """The checkpoint's model (weights loaded, eval, CPU) and task, built without its dataset."""
    from fastvision import engine
    from fastvision.engine import checkpoint

    ckpt_path = checkpoint_path(path)
    ckpt, cfg = checkpoint.load_run_checkpoint(ckpt_path)
    cfg.train.device, cfg.train.compile, cfg.train.backend = "cpu", False, "ddp"  # one process, eager, on CPU
    try:
        run = engine.build(cfg, data_info=ckpt.get("data_info", {}))  # the engine's build, without the dataset
    except ConfigError as e:  # a setting of another version: it named neither file nor version
        raise ConfigError(f"{ckpt_path}: its model does not build{checkpoint.saved_by(ckpt)}: {e}") from e
    model, task = run.model, run.task
    # EMA weights when trained with EMA
    checkpoint.load_model_weights(model, ckpt.get("eval_model", ckpt["model"]), ckpt_path, cfg.model.name)
    shape = image_input_shape(cfg, task)
    if shape is not None:
        task.sample_shape = shape
    return model.eval(), task, ckpt_path


def image_input_shape(cfg, task: Task) -> tuple[int, ...] | None:
    """The input export traces: ``(C, H, W)`` a 2-D run over image files predicts at (``data.args.channels``
    x ``data.args.image_size``, as ``predict`` feeds its model), a volume run's window (below), else None.
    ``task.args.sample_shape`` is benchmark mode's synthetic size: a run trained at
    ``image_size=[512,512]`` or on RGB (``channels: 3``) never saw the recipe's ``[1, 128, 128]``.
    A volume run with a sliding window: ``(C, *task.args.sliding_window.roi_size)``, the windows ``predict``
    feeds the model (unet3d-spleen-fast's 160^3; it exported at the 96^3 training patch, a file no sliding
    window of the run's could use); a roi side <= 0 (the whole axis) keeps ``sample_shape``."""
    shape, size = getattr(task, "sample_shape", None), cfg.data.args.get("image_size")
    roi = (getattr(task, "sliding_window", None) or {}).get("roi_size")
    if cfg.data.name != "microscopy" and shape is not None and isinstance(roi, (list, tuple)) \
            and len(roi) == len(shape) - 1 and all(r > 0 for r in roi):
        # a volume run: predict feeds the model sliding windows of roi_size (a smaller volume padded up to it)
        return (int(shape[0]), *(int(r) for r in roi))
    if cfg.data.name != "microscopy" or shape is None or not isinstance(size, (list, tuple)) \
            or len(size) != len(shape) - 1:
        return None
    return (int(cfg.data.args.get("channels", 1)), *(int(s) for s in size))


@contextlib.contextmanager
def staged(path: Path) -> Iterator[Path]:
    """A path in a temp folder beside ``path``, for an exporter that writes files of its own (ONNX's external
    weights beside the model): when the block ends without an error, what it wrote there is fsynced and
    renamed into ``path``'s folder; after an error nothing is (``path`` keeps what it held)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with term_exits():  # a kill while exporting or fsyncing exits through the finally
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            yield tmp / path.name
            for f in sorted(tmp.iterdir(), key=lambda f: f.name == path.name):  # the model last: its data first
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                os.replace(f, path.parent / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def export_checkpoint(ckpt: str | Path, fmt: str, out: str | Path | None = None, opset: int | None = None,
                      check: bool = True, tolerance: float = 1e-4, seed: int = 0) -> dict[str, Any]:
    """Export a run's model and check it on a random input of batch size 3.

    Args:
        ckpt: checkpoint file or run directory.
        fmt: "onnx" or "torchscript".
        out: output file; default next to the checkpoint (``best.onnx``, ``best.torchscript.pt``).
        opset: ONNX opset (None: exporter default).
        check: run the exported file and compare with PyTorch.
        tolerance: largest accepted absolute difference.
        seed: seed of the random check input.

    Returns:
        ``{"path", "format", "input_shape", "max_abs_diff", "checked", "ok"}``; ``max_abs_diff``
        is None when the check could not run (onnxruntime missing) or was switched off.
    """
    check_opset(fmt, opset)
    check_out_format(fmt, out)
    if not math.isfinite(tolerance) or tolerance < 0:  # -1 or nan failed every export's check, after exporting
        raise ConfigError(f"--tolerance {tolerance:g}: a finite number >= 0")
    path = Path(out) if out else checkpoint_path(Path(ckpt)).with_suffix(SUFFIX[fmt])
    not_the_checkpoint(path, checkpoint_path(Path(ckpt)))
    model, task, ckpt_path = load_model(Path(ckpt))
    example = model_input(model, task)
    diff = None
    with staged(path) as tmp:  # ``path`` is replaced only by a finished export: never a half-written file
        export_model(model, example, tmp, fmt, opset)
        if fmt == "onnx" and opset is not None:
            written_opset_is(tmp, opset)
        if check:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(3, *example.shape[1:], generator=g, dtype=example.dtype)  # another batch size
            diff = max_abs_diff(tmp, fmt, model, x)
            if diff is None:
                log.warning("onnxruntime is not installed: %s was not checked (pip install onnxruntime)", path)
    ok = diff is None or diff <= tolerance
    if not ok:
        log.error("%s differs from the PyTorch model by %.3g (> %.1g)", path, diff, tolerance)
    return {"path": str(path), "format": fmt, "input_shape": ["batch", *example.shape[1:]],
            "max_abs_diff": diff, "checked": diff is not None, "ok": ok}


# ------------------------------------------------------------------------------ CLI
def add_cli(subparsers) -> None:
    """``fastvision export CKPT --format onnx|torchscript``."""
    p = subparsers.add_parser("export", help="export a checkpoint's model to ONNX or TorchScript",
                              description="Export the bare model of a checkpoint or run directory (dynamic "
                                          "batch axis) and check it against PyTorch on a random input.")
    p.add_argument("checkpoint", help="checkpoint file or run directory (best.pt, else last.pt)")
    p.add_argument("--format", choices=FORMATS, default="onnx")
    p.add_argument("--out", help="output file (default: next to the checkpoint)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's, 18)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs difference accepted (default 1e-4)")
    p.add_argument("--no-check", action="store_true", help="skip running the exported file")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from fastvision.api import refuse_overwrite

    out = args.out
    if out is not None and (out.endswith(("/", os.sep)) or out in (".", "..")):  # was written as a file of that name
        raise ConfigError(f"--out {out}: names a folder; give a file path such as {Path(out) / 'best'}"
                          f"{SUFFIX[args.format]}")
    check_out_format(args.format, out)  # before the overwrite check: a refusal names the real mistake
    if out is None:  # the default file beside the checkpoint (a run folder: best.pt, else last.pt)
        ckpt = Path(args.checkpoint)
        if ckpt.is_dir():
            ckpt = next((c for c in (ckpt / "checkpoints" / "best.pt", ckpt / "checkpoints" / "last.pt")
                         if c.is_file()), None)
        out = ckpt.with_suffix(SUFFIX[args.format]) if ckpt is not None else None
    if out is not None:
        refuse_overwrite(out, args.force, file=True)
    result = export_checkpoint(args.checkpoint, args.format, args.out, args.opset, check=not args.no_check,
                               tolerance=args.tolerance)
    shape = "x".join(str(s) for s in result["input_shape"])
    if result["checked"]:
        verdict = "ok" if result["ok"] else "MISMATCH"
        print(f"wrote {result['path']} (input {shape}); max abs diff {result['max_abs_diff']:.3g}: {verdict}")
    else:
        print(f"wrote {result['path']} (input {shape}); not checked"
              + ("" if args.no_check else " (onnxruntime not installed)"))
    return 0 if result["ok"] else 1
