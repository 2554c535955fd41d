"""Which training features compose: one table, per pair of features, "works, proven by <test id>",
"refused: <reason>" or "pending: <reason>" (not proven yet; allowed to run). The table drives
``options.py``'s checks (a refused pair is one ``parser.error`` line, exit 2, before anything starts) and
generates the matrix of docs/composition.md (tests/test_composition.py checks the page against it).

Declaring a feature (one :func:`feature` line) and its pairs (one :func:`works` / :func:`refused` /
:func:`pending` line per pair) is all a new option needs; :func:`fallback` gives every pair of a feature
not yet declared one cell (a feature being built says why its pairs are not proven)::

    feature("--ep", lambda a: getattr(a, "ep", 1) > 1, lambda a: f"--ep {a.ep}")
    works("--ep", "--fsdp", "tests/test_expert_parallel.py::test_ep_with_fsdp")
    refused("--ep", "--tp", "the experts' dispatch assumes whole hidden states on every rank")
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Literal

__all__ = [
    "Cell",
    "Feature",
    "FEATURES",
    "active",
    "cell",
    "fallback",
    "feature",
    "markdown",
    "pairs",
    "pending",
    "proven_together",
    "refusal",
    "refused",
    "works",
]

Status = Literal["works", "refused", "pending"]


@dataclass(frozen=True)
class Feature:
    """A training option as the table names it: ``flag`` (e.g. ``"--encoder spread"``), ``on(args)`` whether a
    parsed command line uses it, ``label(args)`` how a refusal names it (``"--tp 2"``)."""

    flag: str
    on: Callable[[argparse.Namespace], bool]
    label: Callable[[argparse.Namespace], str]


@dataclass(frozen=True)
class Cell:
    """One pair's status: ``works`` with ``proof`` (a test id ``tests/FILE.py::test_name``, the run whose
    losses equal the model's own), ``refused`` with ``reason`` (the error's and the docs' words), or
    ``pending`` with ``reason`` (not proven together yet; not refused)."""

    status: Status
    text: str

    @property
    def proof(self) -> str | None:
        return self.text if self.status == "works" else None

    @property
    def reason(self) -> str | None:
        return None if self.status == "works" else self.text


#: the features in the matrix's order (:func:`feature` appends)
FEATURES: dict[str, Feature] = {}
_CELLS: dict[frozenset[str], Cell] = {}
_FALLBACK: dict[str, Cell] = {}


def feature(flag: str, on: Callable[[argparse.Namespace], bool],
            label: Callable[[argparse.Namespace], str] | None = None) -> Feature:
    """Declare a feature (``flag`` as users write it); ``label`` defaults to the flag itself."""
    if flag in FEATURES:
        raise ValueError(f"composition: feature {flag} declared twice")
    FEATURES[flag] = Feature(flag, on, label or (lambda args: flag))
    return FEATURES[flag]


def _declare(a: str, b: str, value: Cell) -> None:
    unknown = [f for f in (a, b) if f not in FEATURES]
    if unknown or a == b:
        raise ValueError(f"composition: pair ({a}, {b}): {'unknown feature ' + ', '.join(unknown) if unknown else 'a feature with itself'}")
    key = frozenset((a, b))
    if key in _CELLS:
        raise ValueError(f"composition: pair ({a}, {b}) declared twice")
    _CELLS[key] = value


def works(a: str, b: str, proof: str) -> None:
    """``a`` with ``b`` works; ``proof`` is the test id of the run that shows it (``tests/F.py::test_x``)."""
    _declare(a, b, Cell("works", proof))


def refused(a: str, b: str, reason: str) -> None:
    """``a`` with ``b`` is refused before anything starts, for ``reason`` (a user's reason, not "untested")."""
    _declare(a, b, Cell("refused", reason))


def pending(a: str, b: str, reason: str) -> None:
    """``a`` with ``b`` is not proven yet (allowed to run), for ``reason``."""
    _declare(a, b, Cell("pending", reason))


def proven_together(flags: tuple[str, ...], proof: str) -> None:
    """Every pair of ``flags`` not declared yet works, proven by ``proof``: one run with all of them on
    whose losses are the model's own."""
    for i, a in enumerate(flags):
        for b in flags[i + 1:]:
            if frozenset((a, b)) not in _CELLS:
                works(a, b, proof)


def fallback(flag: str, reason: str) -> None:
    """Every pair of ``flag`` without a declared cell is pending for ``reason`` (a feature being built)."""
    if flag not in FEATURES:
        raise ValueError(f"composition: fallback for unknown feature {flag}")
    _FALLBACK[flag] = Cell("pending", reason)


def cell(a: str, b: str) -> Cell:
    """The cell of the pair (either order).

    Raises:
        KeyError: the pair has no cell and neither feature a fallback.
    """
    key = frozenset((a, b))
    if key in _CELLS:
        return _CELLS[key]
    for flag in (a, b):
        if flag in _FALLBACK:
            return _FALLBACK[flag]
    raise KeyError(f"composition: no cell for ({a}, {b})")


def pairs() -> list[tuple[str, str, Cell]]:
    """Every pair of declared features in the matrix's order, with its cell."""
    flags = list(FEATURES)
    return [(a, b, cell(a, b)) for i, a in enumerate(flags) for b in flags[i + 1:]]


def active(args: argparse.Namespace) -> list[str]:
    """The features a parsed command line uses, in the matrix's order."""
    return [flag for flag, f in FEATURES.items() if f.on(args)]


def refusal(args: argparse.Namespace) -> str | None:
    """The first refused pair among the features ``args`` uses, as one line, or None."""
    on = active(args)
    for i, a in enumerate(on):
        for b in on[i + 1:]:
            found = cell(a, b)
            if found.status == "refused":
                return (f"{FEATURES[a].label(args)} with {FEATURES[b].label(args)}: {found.reason} "
                        f"(docs/composition.md); drop one of them")
    return None


_MARK = {"works": "yes", "refused": "**no**", "pending": "?"}


def markdown() -> str:
    """The docs' matrix: a grid (yes / **no** / ?) and every pair with its proof or reason."""
    flags = list(FEATURES)
    lines = ["| | " + " | ".join(f"`{f}`" for f in flags) + " |", "|---" * (len(flags) + 1) + "|"]
    for a in flags:
        row = ["" if a == b else _MARK[cell(a, b).status] for b in flags]
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += ["", "| pair | status | proof or reason |", "|---|---|---|"]
    for a, b, c in pairs():
        lines.append(f"| `{a}` + `{b}` | {c.status} | {f'`{c.proof}`' if c.proof else c.reason} |")
    return "\n".join(lines) + "\n"


# -- the table ---------------------------------------------------------------------------------------

def _int_flag(name: str) -> Feature:
    attr = name[2:].replace("-", "_")
    return feature(name, lambda a: int(getattr(a, attr, 0) or 0) > (0 if attr == "lora_rank" else 1),
                   lambda a: f"{name} {getattr(a, attr)}")


feature("--data", lambda a: bool(a.data))
feature("--pack", lambda a: bool(a.pack))
feature("--presplit", lambda a: bool(a.presplit))
feature("--fsdp", lambda a: bool(a.fsdp))
feature("--bf16", lambda a: bool(a.bf16))
_int_flag("--tp")
_int_flag("--ep")
_int_flag("--lora-rank")
_int_flag("--cp")
feature("--encoder spread", lambda a: a.encoder == "spread")
feature("--activation-checkpointing", lambda a: bool(a.activation_checkpointing))
feature("--freeze", lambda a: bool(a.freeze), lambda a: f"--freeze {','.join(a.freeze)}")
feature("--eval-data", lambda a: bool(a.eval_data))
feature("--resume", lambda a: bool(a.resume))

DATA = "tests/test_train_data.py::"
STACK = "tests/test_stack_mp.py::"
RESUMED = DATA + "test_shuffled_run_resumed_at_another_layout_continues_identically"
MP = "tests/test_composition_mp.py::"

works("--data", "--pack", "tests/test_pack_data.py::test_pack_logs_the_unpacked_losses_step_for_step")
works("--data", "--presplit", RESUMED)
works("--data", "--fsdp", RESUMED)
works("--data", "--encoder spread", DATA + "test_the_spread_on_a_checkpoint_and_data_file_matches_and_reads_each_file_once")
works("--data", "--eval-data", DATA + "test_lr0_losses_are_the_models_own")
works("--data", "--resume", RESUMED)
works("--presplit", "--fsdp", RESUMED)
works("--presplit", "--resume", RESUMED)
works("--fsdp", "--resume", "tests/test_fsdp_dcp.py::test_a_checkpoint_resumes_on_another_layout_with_the_same_losses")
works("--fsdp", "--bf16", STACK + "test_fsdp2_mixed_precision_stays_within_the_measured_tolerance")
works("--fsdp", "--tp", STACK + "test_tensor_parallel_stages_match_the_full_batch_model")
works("--fsdp", "--encoder spread", STACK + "test_the_encoder_spread_with_data_parallel_replicas")
works("--presplit", "--encoder spread", STACK + "test_presplit_microbatches_match_the_staging_path_and_the_model")
works("--pack", "--fsdp", STACK + "test_packed_rows_at_pp2_x_dp2_with_fsdp2")
refused("--tp", "--encoder spread", "both split the same vision work: --tp gives stage 0's microbatch k to its tp "
        "rank k % tp, --encoder spread gives microbatches to the pipeline ranks; combined, every tp column would "
        "encode its share again (tp times the tower's work), so it is not built")
LORA = "tests/test_lora_mp.py::"
LORA_PARITY = LORA + "test_losses_and_adapters_equal_peft_trained_in_one_process"  # one spawn, every layout
works("--lora-rank", "--data", LORA + "test_the_pages_lines_train_and_export_an_adapter_peft_loads")
for _flag in ("--fsdp", "--tp", "--presplit", "--encoder spread", "--activation-checkpointing", "--freeze", "--resume"):
    works("--lora-rank", _flag, LORA_PARITY)
# expert parallelism (issue 35): docs/expert-parallel.md
EP = "tests/test_expert_parallel_mp.py::"
EP_PARITY = EP + "test_expert_parallel_layouts_match_the_model_and_planted_bugs_fail"
works("--ep", "--data", EP + "test_train_with_ep_gives_the_models_losses_resumes_without_ep_and_exports")
works("--ep", "--resume", EP + "test_train_with_ep_gives_the_models_losses_resumes_without_ep_and_exports")
works("--ep", "--fsdp", EP_PARITY)
works("--ep", "--tp", EP_PARITY)
refused("--ep", "--bf16", "FSDP2's mixed precision casts the parameters it shards, not the expert shards it leaves "
        "out of FSDP2")
# one spawn of 4 processes, several features a run (tests/test_composition_mp.py, SCENARIOS)
proven_together(("--data", "--pack", "--tp", "--activation-checkpointing", "--freeze", "--eval-data"),
                MP + "test_tp_with_data_pack_eval_checkpointing_and_freeze_gives_the_models_losses")
proven_together(("--data", "--tp", "--presplit", "--resume", "--freeze", "--eval-data"),
                MP + "test_tp_presplit_resumed_from_the_tp_checkpoint_continues_as_the_model")
proven_together(("--data", "--fsdp", "--encoder spread", "--presplit", "--pack", "--activation-checkpointing",
                 "--freeze", "--eval-data", "--resume"),
                MP + "test_the_tp_checkpoint_resumes_at_pp2_dp2_fsdp_with_the_spread_presplit_and_pack")
proven_together(("--bf16", "--data", "--fsdp", "--tp", "--encoder spread", "--pack", "--presplit",
                 "--activation-checkpointing", "--freeze", "--eval-data", "--resume"),
                MP + "test_bf16_compositions_stay_within_the_bf16_tolerance")
# on a Qwen3-VL-MoE checkpoint: --ep with the data features; LoRA (adapters on the linear layers, the routed
# experts' 3-D weights frozen with the base) with --ep, and with --bf16, against PEFT's own model
proven_together(("--data", "--ep", "--pack", "--presplit", "--encoder spread", "--activation-checkpointing",
                 "--freeze", "--eval-data"),
                MP + "test_ep_with_pack_presplit_spread_checkpointing_freeze_and_eval_gives_the_models_losses")
proven_together(("--data", "--lora-rank", "--ep", "--pack", "--eval-data"),
                MP + "test_lora_with_ep_pack_and_eval_gives_peft_models_losses")
proven_together(("--data", "--lora-rank", "--fsdp", "--bf16", "--pack", "--eval-data"),
                MP + "test_lora_with_bf16_stays_within_the_bf16_tolerance_of_peft")

# context parallelism (issue 41, on main): its refusals with their reasons (docs/context-parallel.md)
works("--cp", "--data", "tests/test_context_parallel_train.py::test_pp2_cp2_trains_as_the_model_and_resumes_without_cp")
refused("--cp", "--fsdp", "FSDP2 reduce-scatters over the dp mesh only; the cp ranks' gradients are summed by an "
        "all-reduce of whole gradients, which sharded parameters do not have")
refused("--cp", "--tp", "the gathered attention takes whole heads; tensor-parallel heads with cp are not built")
refused("--cp", "--encoder spread", "the spread's features are made for whole rows on stage 0's rank; under cp "
        "every cp rank of stage 0 encodes its rows' media itself")
refused("--cp", "--activation-checkpointing", "a layer recomputed in the backward runs outside the stage's "
        "forward, where the microbatch's cp mask is not set")
refused("--cp", "--lora-rank", "LoRA adapters with cp are not built")
refused("--cp", "--ep", "expert parallelism is carved out of the dp ranks; with cp it is not built")
works("--cp", "--resume", "tests/test_context_parallel_train.py::test_pp2_cp2_trains_as_the_model_and_resumes_without_cp")
refused("--cp", "--bf16", "--bf16 is FSDP2's mixed precision (it needs --fsdp), and FSDP2 does not go with --cp")
proven_together(("--cp", "--data", "--pack", "--presplit", "--freeze", "--eval-data", "--resume"),
                MP + "test_cp_with_pack_presplit_freeze_and_eval_resumed_from_the_tp_checkpoint_is_the_model")
