"""Megatron-Core GPTModel from a Hugging Face config: Llama, Qwen2 and Qwen3 families.

The layer spec is TransformerEngine's when CUDA and TE are both present (fused norms and
linears, THD packed attention) and Megatron's local spec otherwise (CPU, or GPU without TE),
with its core attention computed by torch's fused scaled_dot_product_attention.
Megatron initialises the weights; the backend then copies them in from the HF checkpoint.
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
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

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
) -> TransformerConfig:
    """Megatron's TransformerConfig for an HF Llama/Qwen2/Qwen3 architecture."""
    return TransformerConfig(
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
        # The loss is already normalised by the global token count (trainer/loss.py): Megatron
        # must neither divide by the micro-batch count nor average gradients over DP ranks.
        calculate_per_token_loss=True,
        variable_seq_lengths=pp_size > 1,  # packed micro-batches differ in length
        moe_token_dispatcher_type="alltoall",  # no MoE; the default "allgather" rejects variable lengths
        # Fused kernels exist only with TE/apex on GPU; the local spec rejects them.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=use_te,
        sequence_parallel=False,
    )


class SdpaDotProductAttention(DotProductAttention):
    """Megatron's local core attention, computed by torch's fused scaled_dot_product_attention.

    Same contract as DotProductAttention: query [s, b, heads, d], key/value [s, b, groups, d],
    bool mask [b, 1, s, s] with True = masked; returns [s, b, heads * d]. The stock version
    materialises the [b, heads, s, s] scores, repeats K/V per group and runs softmax and mask
    as separate passes; with packed micro-batches s is the whole micro-batch, and on CPU a
    train step of the built-in model took 2.8x as long as with the fused kernel.
    """

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("packed (THD) attention and attention bias need the TransformerEngine spec")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None,
            dropout_p=self.config.attention_dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=True,
        )
        return context.permute(2, 0, 1, 3).reshape(
            query.shape[0], query.shape[1], self.hidden_size_per_partition
        )


def layer_spec(dims: ModelDims, *, use_te: bool) -> ModuleSpec:
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=dims.qk_norm)
    spec = get_gpt_layer_local_spec(qk_layernorm=dims.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
    return spec


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


def build_gpt(dims: ModelDims, config: TransformerConfig, *, use_te: bool) -> GPTModel:
    """This pipeline stage's GPTModel (model-parallel state must be initialised); the last stage
    returns hidden states, not logits (HiddenStateGPTModel)."""
    return HiddenStateGPTModel(
        config=config,
        transformer_layer_spec=layer_spec(dims, use_te=use_te),
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
