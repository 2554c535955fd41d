"""The vision-encoder cost model: relative FLOPs of an encoder sequence (an image, a video, a crop).

:func:`encoder_flops` is the default of :meth:`VlmAdapter.image_costs
<ppmedia.adapters.base.VlmAdapter.image_costs>`, which the balancer (:mod:`ppmedia.balance`) and the
planner (:mod:`ppmedia.planning.loads`) weigh samples with. It reads only the model config: no torch, no other
ppmedia module, so an adapter can use it without importing the balancer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["encoder_flops", "vision_value"]


def vision_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` set on ``config.vision_config`` (or ``config`` itself), else ``default``."""
    vision = getattr(config, "vision_config", None) or config
    for name in names:
        value = getattr(vision, name, None)
        if value is not None:
            return value
    return default


def encoder_flops(patches: np.ndarray, config: Any = None) -> np.ndarray:
    """Relative forward FLOPs of a ViT-style encoder on sequences of ``patches`` patches each.

    Per layer and patch, the linear layers cost ``2 * (4 d^2 + 2 d m)`` (q, k, v, output projections
    and a two-matrix MLP of width ``m``), and attention ``4 d * span``: ``span`` is the sequence
    itself under full attention (quadratic in patches) and the window under windowed attention
    (Qwen2.5-VL: ``window_size / patch_size`` squared patches, except the ``fullatt_block_indexes``
    layers). Without a config: ``patches`` (linear).

    Args:
        patches: int ``[sequences]``: patches per encoder sequence (image, video, crop).
        config: the model config (its ``vision_config`` is read), or ``None``.
    """
    p = np.asarray(patches, dtype=np.float64)
    if config is None:
        return p
    d = float(vision_value(config, "hidden_size", "embed_dim", "width", default=1024))
    m = float(vision_value(config, "intermediate_size", default=4 * d))
    depth = int(vision_value(config, "depth", "num_hidden_layers", "num_layers", default=24))
    full = vision_value(config, "fullatt_block_indexes", default=None)
    window_px = vision_value(config, "window_size", default=None)
    patch = vision_value(config, "patch_size", default=None)
    n_full = depth if full is None or not window_px or not patch else len(full)
    window = float((int(window_px) // int(patch)) ** 2) if window_px and patch else 0.0
    linear = 2.0 * (4 * d * d + 2 * d * m) * p * depth
    attention = 4.0 * d * p * (n_full * p + (depth - n_full) * np.minimum(p, window))
    return linear + attention
