"""tserve's own forward pass for Llama-family decoders (Llama, Mistral, Qwen2).

The Hugging Face modules run a step as a few hundred small module calls, each
with its own dispatch, and three or two separate products where one would do.
:class:`PagedLlama` takes the weights of a loaded Hugging Face model (no
loading code of its own) and runs the same arithmetic over the packed
``[T, hidden]`` tokens of a step:

* one product for Q, K and V together and one for the MLP's gate and up
  projections (fewer, larger products: each a :class:`~tserve.gpu._gemm.TunedLinear`
  once the runner tunes it);
* the residual add done in place just before each RMSNorm;
* RoPE from a cos/sin table built once for every position (the model's own
  rotary module computes it, so scaled variants come out the same), applied to
  the Q and K heads in one pass;
* attention through :func:`~tserve.gpu._attention.paged_attention_forward`,
  the same paged attention the Hugging Face path uses;
* the final norm and the output head only on the rows that are sampled.

Which models qualify is decided by :func:`unsupported_reason` (architecture,
activation, a RoPE whose angles depend on the position alone); every other
model stays on the Hugging Face path. Sliding-window layers attend over the
whole context here, as on the Hugging Face path (exact within the window).
Device-agnostic: the same code runs on CPU (fp32) and CUDA (bf16).
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.nn.functional as F

from tserve.gpu._attention import (
    AttentionGroup,
    StepMetadata,
    Tokens,
    attend_groups,
    paged_attention_forward,
)
from tserve.gpu._cpu_kernels import CpuKernels, cpu_kernels

__all__ = ["PagedLlama", "unsupported_reason"]

_ARCHITECTURES: Final = frozenset({"llama", "mistral", "qwen2"})
# RoPE types whose angles depend on the position alone, so one table serves every step.
_STATIC_ROPE: Final = frozenset({"default", "linear", "llama3"})


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`PagedLlama` cannot run ``model``, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        return f"model type {model_type!r} is not one of {sorted(_ARCHITECTURES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    if getattr(config, "mlp_bias", False):
        return "the MLP has biases"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    rope_type = getattr(model.model.rotary_emb, "rope_type", None)
    if rope_type not in _STATIC_ROPE:
        return f"RoPE type {rope_type!r} depends on more than the position"
    return None


class _Layer(torch.nn.Module):
    """One decoder layer's weights; ``layer_idx`` names its slice of the KV pool."""

    def __init__(self, hf_layer: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.qkv = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = attn.o_proj
        self.gate_up = _fuse(mlp.gate_proj, mlp.up_proj)
        self.down = mlp.down_proj
        self.attn_norm = hf_layer.input_layernorm.weight
        self.mlp_norm = hf_layer.post_attention_layernorm.weight


class PagedLlama(torch.nn.Module):
    """A Llama-family decoder over packed tokens and tserve's paged KV pool.

    Built from a Hugging Face model that :func:`unsupported_reason` accepts,
    already on its device and dtype; shares its embedding, output head, norms
    and o/down projections (so tied weights stay tied) and holds fused copies
    of its Q/K/V and gate/up weights. The Hugging Face model is not needed
    afterwards. For inference only.
    """

    rope_cos: torch.Tensor  # [positions, D/2]: cos of every position's angles
    rope_sin: torch.Tensor

    def __init__(self, model: Any, *, fused_kernels: bool = True) -> None:
        super().__init__()
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"PagedLlama cannot run this model: {reason}")
        config = model.config
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads or self.num_heads
        self.head_dim: int = getattr(config, "head_dim", None) or (
            config.hidden_size // self.num_heads
        )
        self.eps: float = config.rms_norm_eps
        self.scaling: float = self.head_dim**-0.5
        decoder = model.model
        self.embed: torch.nn.Embedding = decoder.embed_tokens
        self.layers = torch.nn.ModuleList(
            _Layer(layer, i) for i, layer in enumerate(decoder.layers)
        )
        self.norm = decoder.norm.weight
        self.lm_head: torch.nn.Linear = model.lm_head
        cos, sin = _rope_table(decoder.rotary_emb, config.max_position_embeddings, model)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        on_cpu = model.device.type == "cpu" and model.dtype == torch.float32
        self.kernels: CpuKernels | None = cpu_kernels() if on_cpu and fused_kernels else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[len(keep), vocab]`` (model dtype) for the packed rows ``keep``.

        ``input_ids`` and ``positions`` are ``[T]``; writes every token's K/V
        into the pool at ``step.slot_mapping``. Blocks until the device is done
        only where a result must be read back (not here).
        """
        if self.kernels is not None:
            return self._forward_fused(self.kernels, input_ids, positions, step, keep)
        hidden: torch.Tensor = self.embed(input_ids)  # [T, hidden]
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2]
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            residual, x = self._add_norm(hidden, residual, layer.attn_norm)
            hidden = layer.o(self._attention(layer, x, cos, sin, step))
            residual, x = self._add_norm(hidden, residual, layer.mlp_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = layer.down(F.silu(gate).mul_(up))
        assert residual is not None, "a decoder has at least one layer"
        return self._head(residual, hidden, keep)

    def _forward_fused(
        self,
        kernels: CpuKernels,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` with the glue between the products in fused CPU kernels
        (``decode`` reads this layer's ``qkv``, ``k_pool`` and ``v_pool``: it runs
        inside the layer's iteration)."""
        tokens = input_ids.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        residual: torch.Tensor = self.embed(input_ids)  # [T, hidden]; the sums accumulate here
        hidden: torch.Tensor | None = None
        pool = step.pool

        def decode(group: AttentionGroup, new: Tokens) -> torch.Tensor | None:
            if group.shape[1] != 1 or group.fresh:
                return None  # prefill chunks, and keys that are only this step's: torch
            rows = qkv[slice(*group.packed)] if group.packed else qkv[group.q_index]
            return kernels.paged_decode(
                rows, heads, k_pool, v_pool, group.block_tables, group.kv_lens,
                group.shape[2], pool.block_size, self.scaling,
            )  # fmt: skip

        for layer in self.layers:
            assert isinstance(layer, _Layer)
            x = kernels.add_rms_norm(residual, hidden, layer.attn_norm, self.eps)
            qkv = layer.qkv(x)  # [T, (heads + 2 kv_heads) * D]
            k_pool, v_pool = pool.k[layer.layer_idx], pool.v[layer.layer_idx]
            kernels.rope_store(
                qkv, heads, kv_heads, positions, self.rope_cos, self.rope_sin,
                step.slot_mapping, k_pool, v_pool,
            )  # fmt: skip
            split = qkv.view(tokens, heads + 2 * kv_heads, dim)
            new = Tokens(split[:, :heads], split[:, heads : heads + kv_heads], split[:, -kv_heads:])
            out = attend_groups(step.groups, new, k_pool, v_pool, self.scaling, decode)
            hidden = layer.o(out.reshape(tokens, heads * dim))
            x = kernels.add_rms_norm(residual, hidden, layer.mlp_norm, self.eps)
            hidden = layer.down(kernels.silu_mul(layer.gate_up(x)))
        assert hidden is not None, "a decoder has at least one layer"
        return self._head(residual, hidden, keep)

    def _head(
        self, residual: torch.Tensor, hidden: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The last residual add, the final norm and the output head, on the rows ``keep``."""
        if keep.numel() == 0:
            return hidden.new_empty(0, self.embed.num_embeddings)
        last = residual.index_select(0, keep).add_(hidden.index_select(0, keep))
        logits: torch.Tensor = self.lm_head(_rms_norm(last, self.norm, self.eps))
        return logits

    def _add_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + hidden, RMSNorm of it)``; the sum is made in ``residual``'s storage."""
        residual = hidden if residual is None else residual.add_(hidden)
        return residual, _rms_norm(residual, weight, self.eps)

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepMetadata,
    ) -> torch.Tensor:
        """QKV product, RoPE, paged attention: ``x [T, hidden]`` -> ``[T, H * D]``."""
        tokens = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = layer.qkv(x).view(tokens, heads + 2 * kv_heads, self.head_dim)
        qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)  # Q and K heads in one pass
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        out, _ = paged_attention_forward(
            layer,
            q.transpose(0, 1).unsqueeze(0),  # the attention interface's [1, heads, T, D]
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            None,
            scaling=self.scaling,
            tserve_step=step,
        )
        return out.reshape(tokens, heads * self.head_dim)


def _fuse(*linears: torch.nn.Linear) -> torch.nn.Linear:
    """One linear layer whose output is the outputs of ``linears``, concatenated.

    Its weight (and bias) is a new tensor; the originals are left as they are.
    """
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias.detach() for linear in linears if linear.bias is not None]
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if biases:
        assert len(biases) == len(linears), "biases on all of the fused layers or none"
        fused.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False)
    return fused


def _rope_table(rotary: Any, positions: int, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, D/2]``, as the model's rotary module makes them.

    That module returns each angle twice (``[..., D]`` is the table
    concatenated with itself); one half is kept.
    """
    probe = torch.empty(0, device=model.device, dtype=model.dtype)
    ids = torch.arange(positions, device=model.device)[None]
    with torch.no_grad():
        cos, sin = rotary(probe, ids)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, heads, D]`` with ``cos``/``sin`` ``[T, 1, D/2]``: a new tensor.

    The same products and sums as transformers' ``x * cos + rotate_half(x) * sin``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: statistics in fp32, the weight applied in ``x``'s dtype.

    In fp32 that is torch's own ``rms_norm`` with the weight (one call, the
    same values); other dtypes normalize in fp32 and scale after the cast back.
    """
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)
