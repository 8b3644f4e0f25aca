"""Conversion of input elements (nested dicts, tuples and lists of numpy arrays) to torch tensors at the edge."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_torch(element: Any) -> Any:
    if isinstance(element, torch.Tensor):
        return element
    if isinstance(element, np.ndarray):
        if element.dtype.kind in "SUO":
            return element
        return torch.from_numpy(np.ascontiguousarray(element))
    if isinstance(element, np.generic):
        return torch.as_tensor(element)
    if isinstance(element, dict):
        return {k: to_torch(v) for k, v in element.items()}
    if isinstance(element, tuple):
        return tuple(to_torch(v) for v in element)
    if isinstance(element, list):
        return [to_torch(v) for v in element]
    return element
