"""The pipelined, case-sharded NIfTI predict: one model or the ensemble of cross-validation folds.

Per case: read + preprocess (a reader thread) -> the network (the calling thread) -> largest-component
postprocessing, back to the input's voxel grid, atomic write (a writer thread). Both queues hold
one case, so at most four cases are in host memory at once (one read ahead, one in the network,
one waiting for export, one being written), whatever the number of cases.

Probabilities: each weight set's softmax (sigmoid for sigmoid / region models) of the task's
sliding window, averaged over mirrored inputs (``tta_axes``) and over the weight sets. With
``sliding_window.style: nnunet`` nnU-Net's predictor instead: each window's logits averaged over its
mirrored copies, the weight sets' blended logits averaged, then the softmax / sigmoid. On CUDA
they accumulate in fp16 on the device when the volume's probabilities fit in free device memory
(with room for the window's fp32 blend), else in fp32 in host memory while the windows still
run on the device; on a CPU in fp32.

Sharding (``rank``, ``world``): cases sorted by id, rank r takes the cases at positions r, r + w,
... of the whole sorted list (the same list on every rank, whatever is already written), then
skips those whose output exists (unless ``force``): each case is written by exactly one rank, and
a killed job reruns into the same folder and finishes. The output folder's rule is
:func:`prepare_output`.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fastvision.errors import ConfigError, DataError
from fastvision.ops.regions import regions_to_classes
from fastvision.utils.files import atomic_write

log = logging.getLogger(__name__)

MANIFEST = ".fastvision-predict.json"  # what this predict is: a rerun with the same content resumes
QUEUE_DEPTH = 1  # cases waiting on each side of the network (host RAM: 2 * depth + 2 cases)


def input_channels(model: nn.Module) -> int | None:
    """Channels the model's first convolution takes (None if it has none)."""
    conv = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    return conv.in_channels if conv is not None else None


class Mirrored(nn.Module):
    """nnU-Net's mirroring inside each window (``_internal_maybe_mirror_and_predict``): the logits of the
    window and of its copies mirrored along every non-empty subset of ``dims``, each flipped back, averaged."""

    def __init__(self, net: nn.Module, dims: Sequence[int]):
        super().__init__()
        dims = [int(d) for d in dims]
        self.net = net
        self.subsets = [c for k in range(1, len(dims) + 1) for c in itertools.combinations(dims, k)]

    def forward(self, x: Tensor) -> Tensor:
        out = self.net(x).float()
        for c in self.subsets:
            out = out + torch.flip(self.net(torch.flip(x, c)), c).float()
        return out / (len(self.subsets) + 1)


class Ensemble:
    """One architecture, several weight sets (folds): mean probabilities, then labels.

    Args:
        task: the segmentation task (mode, sliding window, classes or regions).
        model: the network (its weights are replaced by each state in turn when there are several).
        states: state dicts, one per member; ``[]`` uses the model's weights as they are.
        device: where the network runs.
        tta_axes: spatial axes (0-based, of (X, Y, Z)) to mirror; every subset is averaged.
        autocast: context manager factory for the forward (the run's precision).
    """

    def __init__(self, task, model: nn.Module, states: Sequence[dict[str, Tensor]], device: torch.device, *,
                 tta_axes: Sequence[int] = (), autocast: Callable[[], Any] = contextlib.nullcontext):
        self.task, self.model, self.device, self.autocast = task, model.eval(), torch.device(device), autocast
        self.states = [{k: v.to(self.device) for k, v in s.items()} for s in states]
        self.tta_axes = tuple(int(a) for a in tta_axes)
        window = dict(task.sliding_window) if task.sliding_window else None
        if window is not None and self.tta_axes:
            window.pop("tta_flips", None)  # --tta decides the mirroring
        self.window = window
        self.nnunet = (window or {}).get("style") == "nnunet"
        if self.nnunet:  # the recipe's mirroring (where --tta did not set it) runs inside the windows
            self.tta_axes = self.tta_axes or tuple(int(a) for a in window.pop("tta_flips", None) or ())
        if self.states:  # a mismatched member fails here, before any case is read
            self.model.load_state_dict(self.states[0])

    def _accumulator(self, x: Tensor, channels: int) -> tuple[torch.device, torch.dtype]:
        """fp16 on the GPU when the probabilities (and the fp32 blend of one pass) fit, else fp32 on the host."""
        if self.device.type != "cuda":
            return self.device, torch.float32
        voxels = x[0, 0].numel()
        # fp16 accumulator, the window's fp32 blend, its softmax, a mirrored copy; the normaliser
        need = voxels * channels * (2 + 4 * 3) + voxels * 4
        free, _ = torch.cuda.mem_get_info(self.device)
        return (self.device, torch.float16) if need < 0.8 * free else (torch.device("cpu"), torch.float32)

    def _logits(self, x: Tensor, out_device: torch.device, model: nn.Module) -> Tensor:
        t = self.task
        with self.autocast():
            if self.window is None or t.eval_mode == "crop":
                logits = t.eval_forward(model, {"image": x})
            else:
                from fastvision.inference.window import sliding_window_inference

                logits = sliding_window_inference(x, model, **{**self.window, "device": out_device})
        return logits.float().to(out_device)

    def _nonlin(self, logits: Tensor) -> Tensor:
        return torch.softmax(logits, 1) if self.task.mode == "softmax" else torch.sigmoid(logits)

    def _probabilities(self, x: Tensor, out_device: torch.device) -> Tensor:
        return self._nonlin(self._logits(x, out_device, self.model))

    @torch.no_grad()
    def probabilities(self, image: Tensor) -> Tensor:
        """(C, *S) preprocessed image -> (K, *S) mean probabilities (fp16 on CUDA where they fit)."""
        from fastvision.inference.window import flip_tta

        x = image[None].to(self.device)
        acc = dtype = None
        members = self.states or [None]
        for state in members:
            if state is not None and len(members) > 1:
                self.model.load_state_dict(state)
            if acc is None:
                out_device, dtype = self._accumulator(x, getattr(self.task, "num_classes", 2))
            if self.nnunet:  # nnU-Net's predictor: logits, mirrored inside each window, averaged
                model = Mirrored(self.model, [2 + a for a in self.tta_axes]) if self.tta_axes else self.model
                p = self._logits(x, out_device, model)
            else:
                run = functools.partial(self._probabilities, out_device=out_device)
                p = flip_tta(run, x, dims=[2 + a for a in self.tta_axes]) if self.tta_axes else run(x)
            acc = p.to(dtype) if acc is None else acc.add_(p.to(dtype))
        acc = acc / len(members)
        return (self._nonlin(acc.float()).to(acc.dtype) if self.nnunet else acc)[0]

    def labels(self, probs: Tensor) -> Tensor:
        """(K, *S) probabilities -> (*S) uint8 class indices on the host (regions painted inside out)."""
        t = self.task
        if t.mode == "softmax":
            label = probs.argmax(0)
        elif t.mode == "sigmoid":
            label = (probs[0] > 0.5).long()
        else:
            label = regions_to_classes((probs > 0.5)[None], t.regions)[0]
        return label.to(torch.uint8).cpu()


# ----------------------------------------------------------------------------- the output folder
def _ours(p: Path) -> bool:
    """Files this predict leaves besides its outputs: the manifest and a killed writer's temp files."""
    return p.name == MANIFEST or (p.name.startswith(".") and p.name.endswith(".tmp"))


def prepare_output(out: Path, manifest: dict[str, Any] | None, force: bool) -> None:
    """The ``--out`` rule: a new or empty folder, or one holding this very predict's partial output.

    ``out`` may hold files when its manifest (``.fastvision-predict.json``) equals ``manifest``
    (same model files, folds, mirroring and postprocessing): a rerun resumes, skipping written
    cases. Otherwise a non-empty ``out`` needs ``force`` (then every case is predicted again and
    replaced). The manifest is written (atomically) before any case.

    Raises:
        DataError: ``out`` holds something else, naming it and the way out.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: is a file; --out must be a folder")
    found = out / MANIFEST
    others = [p for p in out.iterdir() if not _ours(p)] if out.is_dir() else []
    if found.is_file() and manifest is not None:
        try:
            same = json.loads(found.read_text()) == json.loads(json.dumps(manifest))
        except ValueError:
            same = False
        if not same and not force:
            raise DataError(f"{out}: holds the output of another predict ({MANIFEST} differs: other model, folds, "
                            "--tta or --postprocess); pass --force to replace it, or choose another --out")
    elif others and not force:
        raise DataError(f"{out}: folder is not empty (e.g. {others[0].name}); pass --force to overwrite, "
                        "or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    if manifest is not None:
        text = json.dumps(manifest, indent=2, sort_keys=True).encode()
        atomic_write(found, lambda f: f.write(text))


def output_name(case: dict) -> str:
    """The file a case's prediction is written to: ``<case>.nii.gz``, or an nnU-Net v2 run's ``<case><file_ending>``."""
    return case.get("out_name") or f"{case['id']}.nii.gz"


def check_not_inputs(cases: Sequence[dict], out: Path) -> None:
    """Before ``out`` is touched: no case's output file (``out/<case>.nii.gz``) is one of the inputs, which
    ``--force`` would replace with its labels (``--out`` the input folder of ``.nii.gz`` files).

    Raises:
        DataError: naming the input and the way out.
    """
    inputs = {Path(p).resolve() for c in cases for p in c["image"]}
    for c in cases:
        target = (Path(out) / output_name(c)).resolve()
        if target in inputs:
            raise DataError(f"{target}: is an input, and its prediction would replace it; choose another --out")


def remove_if_empty(out: Path) -> None:
    """Remove ``out`` when it holds nothing but this predict's own files (no case written): a predict
    stopped by a bad input leaves no folder whose record would refuse the next, different predict."""
    out = Path(out)
    if out.is_dir() and all(_ours(p) and p.is_file() for p in out.iterdir()):
        for p in out.iterdir():
            p.unlink(missing_ok=True)
        out.rmdir()


def shard(cases: Sequence[dict], rank: int, world: int) -> list[dict]:
    """Rank ``rank``'s cases: positions rank, rank + world, ... of the id-sorted list."""
    ordered = sorted(cases, key=lambda c: c["id"])
    return ordered[rank::world]


def check_cases(cases: Sequence[dict], channels: int | None) -> None:
    """Before anything is written (no ``--out`` made): unique case ids, and from the NIfTI headers each
    file 3-D or 4-D, a case's files on one grid, and its channels what the model takes.

    Raises:
        DataError: naming the case's file (a BraTS-named file whose case lacks modalities: which).
    """
    import nibabel as nib

    from fastvision.data.formats.brats_layouts import case_files
    from fastvision.data.preprocess3d import check_channel_file

    seen: dict[str, Path] = {}
    for c in cases:
        first = Path(c["image"][0])
        if c["id"] in seen:
            raise DataError(f"{first}: same case name {c['id']!r} as {seen[c['id']]}: both would write "
                            f"{output_name(c)}")
        seen[c["id"]] = first
        have, grid = 0, None
        for p in c["image"]:
            try:
                img = nib.load(str(p))
            except Exception as e:  # nibabel raises several types for a damaged header
                raise DataError(f"{p}: not a readable NIfTI file ({e})") from e
            check_channel_file(p, img.shape, img.affine, grid)
            grid = grid or (p, img.shape, img.affine)
            have += img.shape[3] if len(img.shape) > 3 else 1
        if channels is not None and have != channels:
            found = case_files(first) if len(c["image"]) == 1 else None
            lacks = [q.name for q in found[1] if not q.is_file()] if found else []
            hint = f"; BraTS case {found[0]} lacks {', '.join(lacks)}" if lacks else ""
            raise DataError(f"{first}: has {have} channel(s), the model expects {channels}{hint}")


# ----------------------------------------------------------------------------- the pipeline
_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if stop.is_set():
                return _END


def run_pipeline(items: Sequence[Any], prepare: Callable[[Any], Any], infer: Callable[[Any], Any],
                 export: Callable[[Any, Any, Any], None], depth: int = QUEUE_DEPTH, overlap: bool = True) -> None:
    """``export(item, prepared, infer(prepared))`` for every item, in order, with ``prepare`` of the
    next items (a thread) and ``export`` of the previous ones (another thread) beside ``infer``
    (this thread). Bounded queues of ``depth``; the first error stops all three and is raised.
    A SIGTERM / SIGHUP (``kill``; torchrun stopping the other ranks after one failed) stops reading too, and
    exits 128 + the signal after the writer has written the cases already through the network: it
    killed the process mid-write, which dropped a finished case and left its temp file.
    ``overlap=False`` runs the three one after another in this thread (the baseline of
    ``benchmarks/predict_pipeline.py``)."""
    from fastvision.utils.files import term_exits

    with term_exits():
        if not overlap:
            for it in items:
                pre = prepare(it)
                export(it, pre, infer(pre))
            return
        _overlapped(items, prepare, infer, export, depth)


def _overlapped(items: Sequence[Any], prepare: Callable[[Any], Any], infer: Callable[[Any], Any],
                export: Callable[[Any, Any, Any], None], depth: int) -> None:
    """:func:`run_pipeline`'s three threads; on an error (or the signal's exit) in this thread the writer
    still writes what is in its queue, then all are joined."""
    stop, errors = threading.Event(), []
    q_in: queue.Queue = queue.Queue(depth)
    q_out: queue.Queue = queue.Queue(depth)

    def reader() -> None:
        try:
            for it in items:
                if not _put(q_in, (it, prepare(it)), stop):
                    return
        except BaseException as e:  # handed to the main thread, which raises it
            _put(q_in, _Failed(e), stop)
            return
        _put(q_in, _END, stop)

    def writer() -> None:
        while (x := _get(q_out, stop)) is not _END:
            try:
                export(*x)
            except BaseException as e:
                errors.append(e)
                stop.set()
                return

    threads = [threading.Thread(target=reader, name="predict-read", daemon=True),
               threading.Thread(target=writer, name="predict-write", daemon=True)]
    for t in threads:
        t.start()
    try:
        while (x := _get(q_in, stop)) is not _END:
            if isinstance(x, _Failed):
                raise x.error
            it, pre = x
            if not _put(q_out, (it, pre, infer(pre)), stop):
                break
        _put(q_out, _END, stop)
    except BaseException:
        stop.set()
        raise
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


def tta_axes(cfg, spatial_dims: int = 3) -> list[int]:
    """The axes the recipe's flip augmentation mirrors (``data.augment.flip.axes``); [] without one."""
    flip = (cfg.data.augment or {}).get("flip")
    if not flip:
        return []
    axes = flip.get("axes", list(range(spatial_dims))) if isinstance(flip, dict) else list(range(spatial_dims))
    bad = [a for a in axes if not 0 <= int(a) < spatial_dims]
    if bad:
        raise ConfigError(f"data.augment.flip.axes {axes}: spatial axes are 0..{spatial_dims - 1}")
    return sorted(int(a) for a in axes)
