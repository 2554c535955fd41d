"""Pipeline stages for a vision-language model: the first stage encodes and merges the staged media.

:func:`build_stage_modules` cuts a ``...ForConditionalGeneration`` model with a registered adapter into
``n_stages`` modules for :class:`torch.distributed.pipelining.PipelineStage`:

* the first stage embeds the text, takes its microbatch's media with
  :func:`~ppmedia.next_vlm_media_chunk`, runs the family's vision encoder and merges the features
  (``adapter.merge``), computes the positions the family needs (Qwen2.5-VL's mrope, from
  ``adapter.position_ids``), then runs its share of the decoder layers;
* a middle stage runs its share of the decoder layers;
* the last stage runs its share of the decoder layers, the final norm and ``lm_head``: logits.

Between stages travels a flat tuple of contiguous tensors (``b`` = microbatch size, ``S`` = sequence
length, ``H`` = text hidden size)::

    hidden_states   [b, S, H]   float, requires grad
    attention_mask  [b, S]      int64 (the batch's own mask)
    *wire tensors               what the adapter declares for the receiving stage
                                (``adapter.wire_tensors(config, first_layer)``, each a
                                :class:`~ppmedia.adapters.base.WireTensor`: name, batch-first static
                                shape, int64 (or the no-gradient dtype it names, e.g.
                                Qwen3-Omni's float32 positions) or float-with-gradient), in
                                declared order

The default declaration is empty, or the mrope positions ``position_ids`` ``[b, 3, S]`` (batch-first:
the ``[3, b, S]`` positions transposed) for adapters that override ``position_ids`` (Qwen2.5-VL).
Qwen3-VL adds its visual position mask ``[b, S]`` and one ``[b, S, H]`` tensor per deepstack level
still ahead (the level's features scattered to the visual positions, zeros elsewhere), so features of
decoder layers on later stages cross the boundary and their gradients flow back to the vision tower.
The first stage builds the wire tensors that come from the media (``adapter.first_stage``); state one
decoder layer hands to a later one (Mistral Large 4's top-k indices and shared KV, Gemma 4's shared
KV, Inkling 2's block states) is made by the layers of whichever stage holds them: each stage runs its language model with
the adapter's hooks on its modules (``adapter.stage_hooks``: hand the model's own code what the stage
received, store what its layers made). Each stage turns what it holds into its language model's
keyword arguments (``adapter.decoder_kwargs``) and sends on what later stages need, received or made
(see ``docs/state-families.md``). The last stage's output is ``adapter.logits`` (``lm_head``, plus
what the model's own forward does after it, e.g. soft-capping).

A stage module keeps only what its stage runs: the first stage the vision tower, projector and
embedding; every stage its decoder layers (under their ORIGINAL indices) and the language model's
rotary embedding; the last stage the final norm and ``lm_head`` (the norm is ``Identity`` elsewhere;
``adapter.prune_stage`` may replace other last-stage-only modules of the language model likewise, or
drop first-stage-only ones: Gemma 4's per-layer-embedding tables).
Parameter names are the full model's (``model.language_model.layers.3.mlp.up_proj.weight`` stays
that on whichever stage holds layer 3), so gradients compare one to one with the full model.
The modules share parameters with ``model``; drop your reference to ``model`` to free the rest.

Around the stages: :func:`schedule_layout` / :func:`build_schedule` take any schedule torch ships by
name (torch's ``get_schedule_class``) and place the stages as it wants (looped or V-shaped);
:func:`shard_batch`, :func:`all_reduce_gradients` and :func:`clip_grad_norm` add data parallelism
(``pp x dp``: each replica a full pipeline on its share of the batch, gradients summed over replicas)
and global-norm clipping; :func:`stage_parameters` lists a rank's parameters for its optimizer,
each once, and :func:`sync_tied_gradients` sums a tied embedding's two copies.

The decoder layers run through the language model's own ``forward`` (called with
``inputs_embeds=``), so its masks and rotary embeddings are the model's own. That forward indexes
``config.layer_types`` by the position of a layer in ``self.layers``; each stage's language model
therefore gets a shallow copy of its config whose ``layer_types`` lists only the stage's layers.

The package, one module per concern (every public name is importable from ``ppmedia.pipeline``):

==================  ===========================================================================
``surgery``         cutting the model's module tree per stage (kept layers, shallow copies)
``layer_split``     the decoder layers over the stages checked before any stage is built (:func:`layer_split_problem`)
``stages``          :class:`StageModule`, :func:`build_stage_modules` (the stage cutter)
``rank_stages``     :func:`make_pipeline_stages`: a rank's ``PipelineStage`` objects, the encoder spread on them
``schedules``       schedules by torch's name, their stage placement, :func:`build_schedule`
``loss``            :func:`make_labels`, :func:`count_valid_tokens`, :func:`pipeline_loss`
``tied``            tied parameters across stages
``parallel``        data parallelism: :func:`shard_batch`, gradient reduction, global-norm clipping
``encoder``         the encoder spread: every pipeline rank encodes a share of the media (:class:`EncoderSpread`)
``lane``            the spread's background lane: jobs on a thread of the lowest priority, in the schedule's idle time
``trace``           measured per-action timelines of a real step (:class:`StepTracer`)
``pretrained``      :func:`stages_from_pretrained`: a rank's stages from a Hugging Face checkpoint
                    (built on meta, only the stage's tensors read, from only their shard files);
                    :func:`vision_from_pretrained`: its vision side alone (the spread's copy)
``export``          :func:`save_pretrained_stages`: the stages back to a Hugging Face checkpoint
``lora``            LoRA adapters on the stages in PEFT's classes and file format (:func:`apply_lora`,
                    :func:`save_lora_adapter`)
``safetensors_files``  which safetensors file holds which tensor; opening only some; writing shards
``fsdp``            FSDP2 inside every stage over the data-parallel mesh (:func:`apply_fsdp`)
``tensor_parallel``  tensor parallelism inside every stage over the ``tp`` mesh (:func:`apply_tensor_parallel`)
``checkpoint``      DCP checkpoints under full-model names, any layout (:func:`save_checkpoint`, ...),
                    a run's identity in them (:func:`claim_save_dir`)
``guards``          a run's preconditions: options, ranks agreeing on a refusal, the same batch on
                    every rank, finite losses (:func:`check_batch_agreement`, :class:`NonFiniteGuard`)
``evaluate``        forward-only evaluation of a batch through the pipeline (:func:`eval_step`)
``optim``           weight-decay groups, AdamW per stage, learning-rate schedules (:func:`stage_adamw`)
``finetune``        frozen parts, activation checkpointing, train mode, the device and its backend
``step``            one training step as pieces of a loop (:class:`ReplicaShare`, :func:`train_step`)
``progress``        the per-step record, the loss log and the progress display (:func:`step_record`)
``step_inputs``     a batch as one step's pre-split microbatches, labels and loss kwargs (:func:`presplit_batch`)
``distributed``     :func:`init_distributed`: the default process group under torchrun or plain ``python``;
                    :func:`pipeline_mesh`: the ``(dp, pp, tp)`` mesh of its ranks
==================  ===========================================================================
"""

from .checkpoint import (
    CHECKPOINT_INFO,
    HYPERPARAMETER_MODES,
    check_checkpoint,
    checkpoint_path,
    claim_save_dir,
    latest_checkpoint,
    load_checkpoint,
    lora_mismatch,
    new_run_id,
    save_checkpoint,
    stage_optimizers,
)
from .encoder import (ENCODER_MODES, EncoderSpread, SpreadPlan, assign_encoders, encoder_spread_of, interleave_encoders,
                      vision_replica)
from .context_parallel import (ContextShard, context_loss, context_problem, enable_context_parallel, local_length,
                               padded_length, reduce_context_gradients)
from .cp_attention import CP_ATTENTION, CP_BACKENDS, CpMask, register_cp_attention
from .cp_vision import CP_VISION_MODES, vision_shard_problem
from .distributed import TORCHRUN_VARIABLES, init_distributed, pipeline_mesh
from .evaluate import eval_step
from .export import LORA_EXPORTS, PROCESSOR_FILE_PATTERNS, copy_processor_files, export_problem, save_pretrained_stages
from .lora import (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, ALL_LINEAR, DEFAULT_LORA_TARGETS, LoraSettings, apply_lora,
                   check_lora_targets, has_lora, initial_lora_weight, lora_settings_of, lora_state_dict, lora_targets,
                   merged_state_dict, peft_key, save_lora_adapter)
from .finetune import (MODEL_PARTS, PROJECTOR_NAMES, enable_activation_checkpointing, freeze, model_part,
                       resolve_device, train_mode)
from .guards import (BatchMismatchError, NonFiniteError, NonFiniteGuard, agree, batch_fingerprint,
                     check_batch_agreement, failure_line, option_problem)
from .optim import LR_SCHEDULES, decay_groups, learning_rate, no_decay, set_learning_rate, stage_adamw
from .progress import LossLog, Progress, format_step, step_record
from .step import (PipelineParts, ReplicaShare, StepResult, batch_to, eval_loss, loader_shares, share_of_global_batch, share_of_replica_batch,
                   train_step)
from .fsdp import (SPLIT_BACKWARD_RESHARD_REASON, apply_fsdp, check_fsdp_schedule, is_sharded, reshards_after_forward,
                   splits_backward)
from .loss import IGNORE_INDEX, count_valid_tokens, make_labels, pipeline_loss
from .parallel import all_reduce_gradients, clip_grad_norm, shard_batch
from .pretrained import checkpoint_dtype, stages_from_pretrained, vision_from_pretrained
from .rank_stages import make_pipeline_stages
from .schedules import (
    SCHEDULE_ALIASES,
    SCHEDULES,
    ScheduleLayout,
    ShapeFollowingSchedule,
    build_schedule,
    schedule_layout,
    schedule_names,
    stage_indices_for_rank,
)
from .stages import StageModule, build_stage_modules, refuse_router_loss, static_stage_args
from .step_inputs import presplit_batch
from .layer_split import default_layer_split, layer_split_problem, max_stages, refuse_empty_stages
from .surgery import find_language_model, find_merge_module
from .expert_parallel import (EP_FAMILIES, AllToAllDispatcher, TokenDispatcher, apply_expert_parallel,
                              check_expert_parallel, expert_parallel_problem, is_expert_shard,
                              reduce_expert_parallel_gradients, routed_expert_count)
from .tensor_parallel import (TP_STYLES, apply_tensor_parallel, check_tensor_parallel, reduce_tensor_parallel_gradients,
                              tensor_parallel_plan)
from .tied import TiedParameters, stage_parameters, sync_tied_gradients, tied_parameters
from .trace import StepTracer

__all__ = [
    "EP_FAMILIES",
    "AllToAllDispatcher",
    "TokenDispatcher",
    "apply_expert_parallel",
    "check_expert_parallel",
    "expert_parallel_problem",
    "is_expert_shard",
    "reduce_expert_parallel_gradients",
    "routed_expert_count",
    "LORA_EXPORTS",
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ALL_LINEAR",
    "DEFAULT_LORA_TARGETS",
    "LoraSettings",
    "apply_lora",
    "check_lora_targets",
    "has_lora",
    "initial_lora_weight",
    "lora_settings_of",
    "lora_state_dict",
    "lora_targets",
    "merged_state_dict",
    "peft_key",
    "save_lora_adapter",
    "BatchMismatchError",
    "CHECKPOINT_INFO",
    "CP_ATTENTION",
    "CP_BACKENDS",
    "CP_VISION_MODES",
    "ContextShard",
    "CpMask",
    "ENCODER_MODES",
    "EncoderSpread",
    "HYPERPARAMETER_MODES",
    "IGNORE_INDEX",
    "LR_SCHEDULES",
    "LossLog",
    "MODEL_PARTS",
    "NonFiniteError",
    "NonFiniteGuard",
    "PROCESSOR_FILE_PATTERNS",
    "PROJECTOR_NAMES",
    "PipelineParts",
    "Progress",
    "ReplicaShare",
    "SCHEDULES",
    "SCHEDULE_ALIASES",
    "SPLIT_BACKWARD_RESHARD_REASON",
    "ScheduleLayout",
    "ShapeFollowingSchedule",
    "SpreadPlan",
    "StageModule",
    "StepResult",
    "StepTracer",
    "TORCHRUN_VARIABLES",
    "TP_STYLES",
    "TiedParameters",
    "agree",
    "all_reduce_gradients",
    "apply_fsdp",
    "apply_tensor_parallel",
    "assign_encoders",
    "batch_fingerprint",
    "batch_to",
    "build_schedule",
    "build_stage_modules",
    "check_batch_agreement",
    "check_checkpoint",
    "check_fsdp_schedule",
    "check_tensor_parallel",
    "checkpoint_dtype",
    "checkpoint_path",
    "claim_save_dir",
    "clip_grad_norm",
    "context_loss",
    "context_problem",
    "copy_processor_files",
    "count_valid_tokens",
    "decay_groups",
    "default_layer_split",
    "enable_activation_checkpointing",
    "enable_context_parallel",
    "encoder_spread_of",
    "eval_loss",
    "eval_step",
    "failure_line",
    "find_language_model",
    "find_merge_module",
    "format_step",
    "freeze",
    "init_distributed",
    "interleave_encoders",
    "is_sharded",
    "latest_checkpoint",
    "layer_split_problem",
    "learning_rate",
    "load_checkpoint",
    "loader_shares",
    "lora_mismatch",
    "local_length",
    "make_labels",
    "make_pipeline_stages",
    "max_stages",
    "model_part",
    "new_run_id",
    "no_decay",
    "option_problem",
    "padded_length",
    "pipeline_loss",
    "pipeline_mesh",
    "presplit_batch",
    "reduce_context_gradients",
    "reduce_tensor_parallel_gradients",
    "refuse_empty_stages",
    "refuse_router_loss",
    "register_cp_attention",
    "reshards_after_forward",
    "resolve_device",
    "save_checkpoint",
    "export_problem",
    "save_pretrained_stages",
    "schedule_layout",
    "schedule_names",
    "set_learning_rate",
    "shard_batch",
    "share_of_global_batch",
    "share_of_replica_batch",
    "splits_backward",
    "stage_adamw",
    "stage_indices_for_rank",
    "stage_optimizers",
    "stage_parameters",
    "stages_from_pretrained",
    "static_stage_args",
    "step_record",
    "sync_tied_gradients",
    "tensor_parallel_plan",
    "tied_parameters",
    "train_mode",
    "train_step",
    "vision_from_pretrained",
    "vision_replica",
    "vision_shard_problem",
]
