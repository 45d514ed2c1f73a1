"""The seam between the generic engine and a problem (segmentation, classification, detection).

The engine never asks "is this detection?": it asks the task to collate, move, augment, compute a
loss and accumulate metrics. A task is built from the recipe's ``task`` section through the
``TASKS`` registry; its builder receives the loss module and the device.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from fastvision.metrics import Evaluator  # noqa: F401  (the task seam re-exports it; it lives with the metrics)


class DeviceConstants:
    """Small constant tensors made once on the host and copied once to each device.

    Copying pageable host memory to a GPU blocks until the copy is done, so building or moving
    a constant inside a training step is a host sync per step; this keeps one copy per device.
    """

    def __init__(self, **tensors: Tensor):
        self._host = tensors
        self._on: dict[tuple[str, torch.device], Tensor] = {}

    def get(self, name: str, device: torch.device) -> Tensor:
        key = (name, device)
        if key not in self._on:
            self._on[key] = self._host[name].to(device)
        return self._on[key]


class Task:
    """Base task: stacked dict batches, ``image`` input, no augmentation.

    Attributes:
        primary_metric: metric name used for the best checkpoint and ``--target`` (e.g. "iou").
        higher_is_better: direction of ``primary_metric``.
        input_key: batch key fed to the model.
        unit_metrics: metrics that are fractions in [0, 1], with their per-class ``NAME/CLASS`` (``--target
            top1=90`` is refused: never reached).
    """

    primary_metric: str = "loss"
    higher_is_better: bool = True
    input_key: str = "image"
    unit_metrics: tuple[str, ...] = ()

    def check_model(self, model: nn.Module) -> None:
        """Refuse, with one ConfigError naming the keys, a model that cannot give this task's outputs
        (called once the model is built, before any step); the base accepts every model."""

    def follow_target(self, metric: str) -> None:
        """Make the recipe's target metric (``train.target: dice=0.94``) the primary one: the run's
        best checkpoint, curves and ``best_*`` then follow what the recipe is judged by. Losses and
        distances (``hd95``) are lower-is-better; an unknown name is refused at the first validation."""
        if metric == self.primary_metric:
            return
        self.primary_metric = metric
        self.higher_is_better = not ("loss" in metric or metric.startswith("hd95"))

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return default_collate(items)

    def to_device(self, batch: dict[str, Any], device: torch.device, channels_last: bool = False) -> dict[str, Any]:
        """Non-blocking copy of every tensor in the batch; the input gets the memory format. The
        per-sample augmentation keys stay on the host (the draws are hashed there)."""
        from fastvision.data.augment.keyed import SAMPLE_KEY

        out = {}
        for k, v in batch.items():
            if isinstance(v, Tensor) and k != SAMPLE_KEY:
                v = v.to(device, non_blocking=True)
                if channels_last and k == self.input_key and v.dim() in (4, 5):
                    v = v.contiguous(memory_format=torch.channels_last if v.dim() == 4 else torch.channels_last_3d)
            out[k] = v
        return out

    def augment(self, batch: dict[str, Any], generator: torch.Generator | None) -> dict[str, Any]:
        """Batched random augmentation on the batch's device (training only). Identity here."""
        return batch

    def forward(self, model: nn.Module, batch: dict[str, Any]) -> Any:
        return model(batch[self.input_key])

    def eval_forward(self, model: nn.Module, batch: dict[str, Any]) -> Any:
        """Validation forward (e.g. sliding window or test-time augmentation); plain forward here."""
        return self.forward(model, batch)

    def loss(self, outputs: Any, batch: dict[str, Any]) -> Tensor:
        """Scalar training loss from model outputs; called inside autocast."""
        raise NotImplementedError

    def evaluator(self) -> Evaluator:
        raise NotImplementedError

    def synthetic_batch(self, batch_size: int, device: torch.device) -> dict[str, Any]:
        """A random batch shaped like real data, for benchmark mode."""
        raise NotImplementedError

    def batch_size(self, batch: dict[str, Any]) -> int:
        return int(batch[self.input_key].shape[0])

    def item_ids(self, batch: dict[str, Any]) -> Any:
        """The batch's item names for messages (``id``, else ``image_id``), as they are: a device
        tensor is not read here (the step calls this; :func:`ids_text` reads at a log interval)."""
        return batch.get("id", batch.get("image_id")) if isinstance(batch, dict) else None


def ids_text(ids: Any) -> list[str]:
    """:meth:`Task.item_ids`'s value as strings (a host read of a device tensor: call off the hot path)."""
    if ids is None:
        return []
    if isinstance(ids, Tensor):
        ids = ids.reshape(-1).tolist()
    return [str(i) for i in ids]
