"""The vision side of a model as a module of its own: what the encoder spread's ranks without stage 0
encode with (:func:`vision_replica`), and the vision parameters every rank's copy holds in the same order.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from ..adapters.base import VlmAdapter
from .stages import StageModule
from .surgery import _child_name, _get_path, _shallow, _stage_children, find_language_model, find_merge_module, find_output_head

__all__ = [
    "vision_replica",
]


class _VisionReplica(nn.Module):
    """The vision side of a model under the full model's names (``model.visual.blocks.0...``)."""

    def __init__(self, children: Mapping[str, nn.Module], parameters: Mapping[str, nn.Parameter], config: Any) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        for name, param in parameters.items():
            self.register_parameter(name, param)
        self.config = config


def vision_replica(model: nn.Module, adapter: VlmAdapter | None = None) -> nn.Module:
    """What the first stage holds besides the language model and head, as a module of its own:
    the vision tower, projector and any root-level parameter, under the full model's names.

    It shares parameters with ``model`` (no copy); the language model in it keeps no decoder layer,
    no embedding, no norm (only its shell, so paths like ``model.model.visual`` resolve), except the
    merge module when the adapter's ``merge_path`` puts it inside (Phi-4-multimodal's
    ``model.embed_tokens_extend``, encoders included), under its own path. An adapter's
    ``encode(replica, chunk, host)`` runs as on the first stage. ``adapter``: the family's (default:
    the registry's), which may say where the language model sits and where it merges.
    """
    lm_path, lm = find_language_model(model, adapter)
    embed_name = _child_name(lm, lm.get_input_embeddings(), "input embedding")
    norm_name = "norm" if isinstance(lm._modules.get("norm"), nn.Module) else None
    head_path = find_output_head(model, lm_path)
    children = _stage_children(model, lm, lm_path, head_path, (0, 0), first=True, last=False,
                               embed_name=embed_name, norm_name=norm_name)
    replica = _VisionReplica(children, {k: v for k, v in model._parameters.items() if v is not None}, model.config)
    shell = _get_path(replica, lm_path)
    assert shell is not None
    shell._modules.clear()  # nothing of the language model: its shell only (a new registry: the model keeps its own)
    shell._parameters.clear()
    shell._buffers.clear()
    merge_path, merge = find_merge_module(model, adapter)
    if merge_path is not None and merge is not None and merge_path.startswith(lm_path + "."):
        _restore_path(shell, lm, merge_path[len(lm_path) + 1 :], merge)
    return replica


def _restore_path(shell: nn.Module, original: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` back at dotted ``path`` under the emptied ``shell`` (of ``original``), with empty
    shells of the modules on the way."""
    head, _, rest = path.partition(".")
    if not rest:
        shell._modules[head] = module
        return
    child = original._modules[head]
    assert child is not None
    inner = _shallow(child, keep_members=False)
    shell._modules[head] = inner
    _restore_path(inner, child, rest, module)


def _vision_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The vision-side parameters of a first-stage module or a replica, sorted by name."""
    if isinstance(module, StageModule):
        named = [(n, p) for n, p in module.named_parameters() if not module.is_language_parameter(n)]
    else:
        named = list(module.named_parameters())
    return sorted(named, key=lambda item: item[0])
