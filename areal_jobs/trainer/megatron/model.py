"""Megatron-Core GPTModel from a Hugging Face config: Llama, Qwen2, Qwen3 and Qwen3-MoE families.

The layer spec is TransformerEngine's when CUDA and TE are both present (fused norms and
linears, THD packed attention) and Megatron's local spec otherwise (CPU, or GPU without TE),
with our core attention (attention.py): per-sequence over THD packed micro-batches, or dense-masked.
`trainer.recompute` maps onto Megatron's own activation recomputation (`recompute_settings`).
Megatron initialises the weights; the backend then copies them in from the HF checkpoint.

Qwen3-MoE: Megatron's MoE layer (`moe_settings`) with the HF router's numerics: softmax router in
fp32, top-k, the top-k weights renormalised when `norm_topk_prob` (Megatron: top-k of the logits,
then softmax over those k) or not (softmax over all experts, then top-k: `moe_router_pre_softmax`);
no shared experts, no token dropping (capacity factor none), experts as a SequentialMLP of plain
linears (grouped GEMM off: the names convert.py maps, and the only expert kernel without TE), tokens
sent to their experts' expert-parallel ranks by the alltoall dispatcher (all_to_all_single over the
EP group: gloo implements it for CPU tensors, with megatron/cpu_compat.py's fixes).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from areal_jobs.config import Attention, Recompute
from areal_jobs.trainer.megatron.attention import PackedCoreAttention
from areal_jobs.trainer.megatron.convert import ModelDims


def read_hf_config(model_path: str) -> dict[str, Any]:
    """config.json of an HF model directory, as a plain dict."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: model.path must be an HF model directory")
    return json.loads(path.read_text())


def use_transformer_engine() -> bool:
    """TE spec only on GPU with TE installed; CPU always uses the local spec."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def transformer_config(
    dims: ModelDims,
    *,
    tp_size: int,
    pp_size: int,
    params_dtype: torch.dtype,
    use_te: bool,
    recompute: Recompute = Recompute.none,
    ep_size: int = 1,
    expert_tp_size: int = 1,
    router_aux_loss_coef: float = 0.0,
) -> TransformerConfig:
    """Megatron's TransformerConfig for an HF Llama/Qwen2/Qwen3/Qwen3-MoE architecture."""
    return TransformerConfig(
        **recompute_settings(recompute),
        **moe_settings(
            dims, ep_size=ep_size, expert_tp_size=expert_tp_size, aux_loss_coef=router_aux_loss_coef
        ),
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        ffn_hidden_size=dims.ffn_hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        kv_channels=dims.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=dims.norm_eps,
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Weights are overwritten from the HF checkpoint, but initialisation must still run: it is
        # what tags TP-split weights (`tensor_model_parallel`), which the grad norm relies on.
        perform_initialization=True,
        # The loss is already normalised by the global token count (trainer/objective/loss.py): Megatron
        # must neither divide by the micro-batch count nor average gradients over DP ranks.
        calculate_per_token_loss=True,
        variable_seq_lengths=pp_size > 1,  # packed micro-batches differ in length
        moe_token_dispatcher_type="alltoall",  # also for dense: the default "allgather" rejects variable lengths
        # Fused kernels exist only with TE/apex on GPU; the local spec rejects them.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=use_te,
        sequence_parallel=False,
    )


def moe_settings(
    dims: ModelDims, *, ep_size: int, expert_tp_size: int, aux_loss_coef: float
) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE model (none for a dense one).

    The load-balancing loss is Megatron's ("aux_loss": per layer, E * sum_e f_e * P_e with f_e the
    share of the top-k assignments, 1.0 when balanced, summed over the layers); `aux_loss_coef` is
    its weight per routed token (the backend sets it per minibatch: megatron/backend.py)."""
    if not dims.is_moe:
        return {}
    return dict(
        num_moe_experts=dims.num_experts,
        moe_router_topk=dims.moe_topk,
        moe_ffn_hidden_size=dims.moe_ffn_hidden_size,
        moe_router_pre_softmax=not dims.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",  # HF's router softmax is fp32 too
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_loss_coef,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_shared_expert_intermediate_size=None,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=expert_tp_size,
    )


def recompute_settings(recompute: Recompute) -> dict[str, Any]:
    """TransformerConfig fields for `trainer.recompute`, in Megatron-Core 0.16's terms.

    full: every decoder layer keeps only its input and runs again in backward (granularity full,
    method uniform over chunks of 1 layer: Megatron-LM's --recompute-granularity full
    --recompute-method uniform --recompute-num-layers 1). selective: the core attention only
    (Attention.checkpoint_core_attention, whatever module the spec puts there: ours in the local
    spec, TE's fused one under TE). It pays where attention keeps large intermediates (the dense
    path's masked scores); a flash-style kernel keeps only its output and log-sum-exp, so there
    selective saves little and full is the mode that frees memory."""
    if recompute is Recompute.full:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute is Recompute.selective:
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


def layer_spec(dims: ModelDims, *, use_te: bool, attention: Attention = Attention.varlen) -> ModuleSpec:
    experts = {"num_experts": dims.num_experts, "moe_grouped_gemm": False} if dims.is_moe else {}
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=dims.qk_norm, **experts)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=dims.qk_norm, normalization="RMSNorm", **experts)
        core = ModuleSpec(module=PackedCoreAttention, params={"kind": attention})
        spec.submodules.self_attention.submodules.core_attention = core
    if dims.o_bias:  # HF attention_bias: o_proj has one; Megatron's add_bias_linear would bias every linear
        proj = spec.submodules.self_attention.submodules
        proj.linear_proj = _with_bias(proj.linear_proj)
    return spec


def _with_bias(linear: type) -> type:
    """`linear` (a row-parallel linear class) built with a bias whatever the config says."""

    def __init__(self, *args, bias: bool, **kwargs):
        linear.__init__(self, *args, bias=True, **kwargs)

    return type(f"Biased{linear.__name__}", (linear,), {"__init__": __init__})


def _router_gemm_without_te() -> None:
    """megatron-core 0.16.1's router linear tests `te_general_gemm is not None`, a name its module
    defines only when TransformerEngine imports: without TE (CPU, or a GPU without TE) the MoE
    router's forward raises NameError. None selects its own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class HiddenStateGPTModel(GPTModel):
    """GPTModel whose last pipeline stage returns the final hidden states `[s, b, H]` (after the
    final norm) instead of logits: the trainer applies the output layer's weight itself, a chunk
    of tokens at a time (megatron/head.py), so `[s, V/tp]` float32 logits never exist.

    The output layer is still built as Megatron builds it (its weight, or the tied embedding's;
    under PP the last stage's copy of it that Megatron keeps in sync), so checkpoints, weight
    loading and the embedding-group gradient reduction are untouched. The one override is
    `_postprocess`, the step after the decoder that would apply that layer (earlier stages already
    return their hidden states from it); multi-token prediction, which it would also run, is not
    used here.
    """

    def _postprocess(self, hidden_states, **kwargs):
        if self.config.mtp_num_layers:
            raise ValueError("multi-token prediction layers are not supported by the trainer")
        return hidden_states

    def output_weight(self) -> torch.Tensor:
        """`[Vp/tp, H]`: the weight GPTModel's own output layer would multiply by (last stage)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight


def build_gpt(
    dims: ModelDims, config: TransformerConfig, *, use_te: bool, attention: Attention = Attention.varlen
) -> GPTModel:
    """This pipeline stage's GPTModel (model-parallel state must be initialised); the last stage
    returns hidden states, not logits (HiddenStateGPTModel)."""
    if dims.is_moe:
        _router_gemm_without_te()
    return HiddenStateGPTModel(
        config=config,
        transformer_layer_spec=layer_spec(dims, use_te=use_te, attention=attention),
        vocab_size=dims.padded_vocab_size,
        max_sequence_length=dims.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # the output weight stays vocab-parallel (megatron/head.py)
        share_embeddings_and_output_weights=dims.tied_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(dims.rope_theta),
    )
