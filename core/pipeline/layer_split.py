"""The decoder layers' split over the pipeline stages, checked before any stage is built.

Stage 0 holds the embedding (and the vision side), the last stage the final norm and the head; every
stage between them holds its decoder layers and nothing else. So a split whose middle stage gets no
layer leaves a stage with nothing to run (and torch's bare "optimizer got an empty parameter list" on
its rank, a peer's "Connection reset" on the next). :func:`layer_split_problem` says so in one line
from the counts alone, before a model is cut; ``build_stage_modules``, ``stages_from_pretrained`` and
``ppmedia.train``'s option checks all ask it, so every rank refuses alike.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["default_layer_split", "layer_split_problem", "max_stages", "refuse_empty_stages"]


def default_layer_split(num_layers: int, n_stages: int) -> list[int]:
    """Decoder layers per stage: as even as possible, extra layers to the stages after the first.

    The first stage already runs the vision encoder, so it is the last to get a remainder layer.
    With fewer layers than stages some stages hold none (2 layers, 4 stages: ``[0, 1, 1, 0]``).
    """
    if n_stages < 1:
        raise ValueError(f"n_stages: got {n_stages}; expected >= 1")
    base, extra = divmod(num_layers, n_stages)
    sizes = [base] * n_stages
    order = list(range(1, n_stages)) + [0]
    for i in range(extra):
        sizes[order[i]] += 1
    return sizes


def max_stages(num_layers: int) -> int:
    """The most pipeline stages ``num_layers`` decoder layers can feed: one per layer, besides the
    first (embedding) and the last (head) stage, which may hold none (2 layers: 4 stages)."""
    return num_layers + 2


def layer_split_problem(n_stages: int, num_layers: int, layers_per_stage: Sequence[int] | None = None, *,
                        stages_option: str = "n_stages", split_option: str = "layers_per_stage",
                        model: str = "the model", fix: str = "use fewer stages") -> str | None:
    """What is wrong with splitting ``num_layers`` decoder layers over ``n_stages`` stages, or ``None``.

    Args:
        n_stages: the pipeline's stage count (all ranks' stages together).
        num_layers: the model's decoder layers (``config.get_text_config().num_hidden_layers``).
        layers_per_stage: the counts per stage, ``n_stages`` of them summing to ``num_layers``; ``None``:
            :func:`~ppmedia.pipeline.default_layer_split`.
        stages_option, split_option: how the message names what sets the stage count and the split
            (``"--pp 3 with --schedule interleaved"``, ``"--layers-per-stage"`` on a command line).
        model: how the message names the model; fix: what it advises for too many stages.

    Returns:
        One line naming the stage count, the layer count and the option to change; ``None`` for a split
        whose every stage holds something.
    """
    if n_stages < 1:
        return f"{stages_option}: got {n_stages} stages; expected >= 1"
    layers = f"the {num_layers} decoder layers of {model}"
    if layers_per_stage is None:
        if n_stages <= max_stages(num_layers):
            return None
        empty = [s for s, n in enumerate(default_layer_split(num_layers, n_stages)) if n == 0 and 0 < s < n_stages - 1]
        return (f"{stages_option}: {n_stages} pipeline stages for {layers}; expected at most {max_stages(num_layers)} "
                f"(one per layer besides the first and the last stage): {_stages(empty)} would hold nothing to run; "
                f"{fix}")
    sizes = list(layers_per_stage)
    if len(sizes) != n_stages or any(s < 0 for s in sizes) or sum(sizes) != num_layers:
        return (f"{split_option}: got {','.join(map(str, sizes))} for {n_stages} pipeline stages ({stages_option}); "
                f"expected {n_stages} counts >= 0 summing to {num_layers} ({layers})")
    empty = [s for s, n in enumerate(sizes) if n == 0 and 0 < s < n_stages - 1]
    if empty:
        return (f"{split_option}: got {','.join(map(str, sizes))}: {_stages(empty)} of {n_stages} would hold nothing "
                f"to run ({layers}; only the first and the last stage may get 0)")
    return None


def _stages(indices: Sequence[int]) -> str:
    return ("stage " if len(indices) == 1 else "stages ") + ", ".join(map(str, indices))


def refuse_empty_stages(modules: Sequence[Any], caller: str) -> None:
    """The last line of defence for stages cut elsewhere: a module without parameters (a stage given no
    decoder layer, no embedding or head) is a ``ValueError`` naming it, not torch's bare "optimizer got
    an empty parameter list" on one rank. ``modules``: stage modules (``nn.Module``)."""
    for module in modules:
        if next(iter(module.parameters()), None) is None:
            index, n = getattr(module, "stage_index", "?"), getattr(module, "n_stages", "?")
            raise ValueError(
                f"{caller}: stage {index} of {n} holds no parameters (no decoder layer, no embedding or head): "
                f"more pipeline stages than the model has decoder layers to give them; use fewer stages (or "
                f"layers_per_stage giving each stage a layer)"
            )
