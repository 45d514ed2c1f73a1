"""Walk the tensors of nested batches and states: dicts, lists and tuples of tensors and other values."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``; containers rebuilt, other leaves shared."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, depth first in container order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)
