"""``fastvision export``'s refusals of its flags and of the written file: the output's name against
``--format``, ``--opset``, ``--out`` the checkpoint itself (each one line, before any work), the opset
the exporter really wrote."""
from __future__ import annotations

import os
from pathlib import Path

from fastvision.errors import ConfigError, check_low

SUFFIX = {"onnx": ".onnx", "torchscript": ".torchscript.pt"}
# endings of the other format's files: read as that one, the file fails (onnxruntime on a TorchScript zip)
OTHER_ENDINGS = {"onnx": (".pt", ".pth", ".ts", ".jit", ".torchscript"), "torchscript": (".onnx",)}


def check_out_format(fmt: str, out: str | Path | None) -> None:
    """``--out`` is not named as the other format's files are (``--format torchscript --out m.onnx``): one line."""
    if out is not None and Path(out).name.lower().endswith(OTHER_ENDINGS[fmt]):
        other, name = {"onnx": ("torchscript", "ONNX"), "torchscript": ("onnx", "TorchScript")}[fmt]
        fit = Path(out).with_name((Path(out).name.split(".")[0] or "model") + SUFFIX[fmt])
        raise ConfigError(f"--out {out}: a {other} file's name, but --format {fmt}{' (the default)' * (fmt == 'onnx')}"
                          f" writes {name}; pass --format {other}, or an --out such as {fit}")


def check_opset(fmt: str, opset: int | None) -> None:
    """``--opset`` is ONNX's and a version the installed ``onnx`` knows (checked before any work).

    Raises:
        ConfigError: naming ``--opset``.
    """
    if opset is None:
        return
    if fmt != "onnx":
        raise ConfigError(f"--opset {opset}: an ONNX setting; --format {fmt} has no opset")
    check_low("--opset", opset, 1)
    try:
        import onnx
    except ImportError:  # export_model names the missing packages
        return
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise ConfigError(f"--opset {opset}: the installed onnx {onnx.__version__} knows opsets up to {newest}")


def written_opset_is(path: Path, opset: int) -> None:
    """The ONNX file at ``path`` is of ``opset``: torch's exporter keeps its own opset, with a logged
    traceback, where it cannot convert the model to the one asked for."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    got = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if got != opset:
        raise ConfigError(f"--opset {opset}: the exporter could not convert this model to opset {opset} "
                          f"(it stays at opset {got}); choose a later --opset, or leave it out")


def not_the_checkpoint(path: Path, ckpt_path: Path) -> None:
    """``--out`` is not the checkpoint being exported (nor another name of it, a hard link such as ``best.pt``
    of ``last.pt``): ``--force`` replaced the run's checkpoint with the exported model."""
    if path.exists() and os.path.samefile(path, ckpt_path):
        raise ConfigError(f"--out {path}: is the checkpoint being exported; choose another --out")
