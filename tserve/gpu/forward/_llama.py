"""tserve's own forward pass for every decoder in :mod:`tserve.gpu.models._architectures`.

The Hugging Face modules run a step as a few hundred small module calls, each
with its own dispatch, and three or two separate products where one would do.
:class:`PagedLlama` takes the weights of a loaded Hugging Face model (no
loading code of its own) and runs the same arithmetic over the packed
``[T, hidden]`` tokens of a step:

* one product for Q, K and V together and one for the MLP's gate and up
  projections (fewer, larger products: each a :class:`~tserve.gpu.forward._gemm.TunedLinear`
  once the runner tunes it);
* the residual add done in place just before each RMSNorm;
* RoPE from a cos/sin table built once for every position (the model's own
  rotary module computes it, so scaled variants come out the same), applied to
  the Q and K heads in one pass;
* attention through :func:`~tserve.gpu.forward._attention.attend_groups`, the same
  paged attention the Hugging Face path uses;
* the final norm and the output head only on the rows that are sampled.

What sets an architecture apart is data (:class:`~tserve.gpu.models._architectures.Architecture`):
a layer holds the optional parts its architecture has (Q/K/V biases, the Q
and K heads' norms) and the one layer loop runs those it holds.

Which models qualify is decided by :func:`unsupported_reason` (architecture,
activation, a RoPE whose angles depend on the position alone); every other
model stays on the Hugging Face path. A layer whose config says
``sliding_attention`` attends to its last ``sliding_window`` keys; where the
runner's pool keeps such layers in KV groups of their own
(:mod:`tserve.gpu.scheduling._kv_groups`), their blocks behind the window go back to the pool.

One forward pass for every device: the glue between the products (residual
add and RMSNorm, RoPE and the K/V write, the MLP activation, decode
attention) is a :class:`~tserve.gpu.forward._step_ops.StepOps` the model
runner picks once from the device and dtype: the fused CPU kernels
(:class:`~tserve.gpu.kernels._cpu_kernels.CpuKernels`, fp32 on CPU) or
:data:`~tserve.gpu.forward._step_ops.TORCH_OPS` (any device and dtype). The
weights come from a Hugging Face model (:meth:`PagedLlama.from_hf`) or from a GGUF file
(:mod:`tserve.gpu.forward._gguf`); a linear layer is any module from ``[T, in]`` to
``[T, out]`` (``nn.Linear``, a tuned one, a quantized one). A quantized
model's short steps may instead run every layer in one call
(:attr:`PagedLlama.decoder`, :mod:`tserve.gpu.forward._decoder`): the same kernels
without Python between them, handed down by the runner like ``ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np
import torch

from tserve.gpu.forward._attention import Tokens, attend_groups
from tserve.gpu.forward._attention_step import AttentionGroup, StepMetadata
from tserve.gpu.forward._step_ops import TORCH_OPS, StepOps
from tserve.gpu.models._architectures import ARCHITECTURES, Architecture, hf_architecture, soft_cap

__all__ = [
    "LayerWeights",
    "PagedLlama",
    "hf_layer_windows",
    "rope_table",
    "unsupported_reason",
]

# RoPE types whose angles depend on the position alone, so one table serves every step.
_STATIC_ROPE: Final = frozenset({"default", "linear", "llama3"})
# transformers' activation names -> Architecture.activation.
_HF_ACTIVATIONS: Final = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`PagedLlama` cannot run ``model``, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if hf_architecture(model_type) is None:
        types = sorted(t for arch in ARCHITECTURES.values() for t in arch.model_types)
        return f"model type {model_type!r} is not one of {types}"
    arch = hf_architecture(model_type)
    assert arch is not None
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if _HF_ACTIVATIONS.get(str(act)) != arch.activation:
        return f"activation {act!r} is not {arch.activation}"
    if getattr(config, "mlp_bias", False):
        return "the MLP has biases"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        return "RoPE on part of each head (partial rotary)"
    rope_type = getattr(model.model.rotary_emb, "rope_type", None)
    for kind in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
        if kind not in _STATIC_ROPE:
            return f"RoPE type {kind!r} depends on more than the position"
    return None


class LayerWeights(torch.nn.Module):
    """One decoder layer's weights; ``layer_idx`` names its slice of the KV pool.
    ``qkv`` gives Q, K and V heads concatenated (Q/K rows in the rotate-half
    order transformers uses); ``gate_up`` the gate, then the up projection.
    The architecture's optional parts, None where it has none: ``qkv_bias``
    ``[qkv out]`` added to ``qkv``'s output (where ``qkv`` has no bias of its
    own), ``q_norm`` and ``k_norm`` ``[head_dim]``, every Q and K head's RMSNorm
    weight before RoPE, ``post_attn_norm`` and ``post_mlp_norm`` ``[hidden]``,
    the RMSNorms of the attention's and the MLP's outputs before each is added
    to the residual; ``window`` > 0: a sliding-window layer attending to its
    last ``window`` keys, with the model's local RoPE table where it has one.
    Every norm weight is the factor itself (Gemma's ``1 + w`` already summed)."""

    def __init__(
        self,
        layer_idx: int,
        *,
        qkv: torch.nn.Module,
        o: torch.nn.Module,
        gate_up: torch.nn.Module,
        down: torch.nn.Module,
        attn_norm: torch.Tensor,
        mlp_norm: torch.Tensor,
        qkv_bias: torch.Tensor | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        post_attn_norm: torch.Tensor | None = None,
        post_mlp_norm: torch.Tensor | None = None,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.attn_norm, self.mlp_norm = attn_norm, mlp_norm
        self.qkv_bias, self.q_norm, self.k_norm = qkv_bias, q_norm, k_norm
        self.post_attn_norm, self.post_mlp_norm = post_attn_norm, post_mlp_norm
        self.window = window

    @classmethod
    def from_hf(
        cls, hf_layer: Any, layer_idx: int, arch: Architecture, window: int
    ) -> LayerWeights:
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        fused = arch.fused_products

        def norm(module: Any) -> torch.Tensor | None:
            if module is None:
                return None
            weight: torch.Tensor = module.weight
            return weight + arch.norm_offset if arch.norm_offset else weight

        post_attn = post_mlp = None
        mlp_norm = hf_layer.post_attention_layernorm
        if arch.post_norms:  # Gemma's names: pre_feedforward_layernorm norms the MLP's input
            post_attn, mlp_norm = mlp_norm, hf_layer.pre_feedforward_layernorm
            post_mlp = hf_layer.post_feedforward_layernorm
        attn_norm, mlp_weight = norm(hf_layer.input_layernorm), norm(mlp_norm)
        assert attn_norm is not None and mlp_weight is not None
        return cls(
            layer_idx,
            qkv=attn.qkv_proj if fused else _fuse(attn.q_proj, attn.k_proj, attn.v_proj),
            o=attn.o_proj,
            gate_up=mlp.gate_up_proj if fused else _fuse(mlp.gate_proj, mlp.up_proj),
            down=mlp.down_proj,
            attn_norm=attn_norm,
            mlp_norm=mlp_weight,
            q_norm=norm(getattr(attn, "q_norm", None)),
            k_norm=norm(getattr(attn, "k_norm", None)),
            post_attn_norm=norm(post_attn),
            post_mlp_norm=norm(post_mlp),
            window=window,
        )


def hf_layer_windows(config: Any) -> list[int]:
    """Each layer's sliding window (0: global) in a transformers config, as
    tserve's own forward pass runs it: ``sliding_window`` on the layers its
    ``layer_types`` call ``sliding_attention``."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    return [window if kind == "sliding_attention" else 0 for kind in types]


class PagedLlama(torch.nn.Module):
    """A Llama-family decoder over packed tokens and tserve's paged KV pool.

    Holds its weights (:meth:`from_hf` shares a Hugging Face model's
    embedding, output head, norms and o/down projections, so tied weights
    stay tied, and makes fused copies of its Q/K/V and gate/up weights) and
    the :class:`~tserve.gpu.forward._step_ops.StepOps` it runs with (``ops``;
    the runner may replace it
    before the first step), and :attr:`decoder` and :attr:`progress`, which
    the runner may set.
    For inference only.
    """

    rope_cos: torch.Tensor  # [positions, D/2]: cos of every position's angles
    rope_sin: torch.Tensor
    local_rope_cos: torch.Tensor  # the sliding-window layers' (the same tensors where shared)
    local_rope_sin: torch.Tensor

    def __init__(
        self,
        *,
        embed: torch.nn.Module,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.nn.Module,
        rope: tuple[torch.Tensor, torch.Tensor],
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        vocab_size: int,
        ops: StepOps = TORCH_OPS,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        scale: float | None = None,
        embed_scale: float = 1.0,
        activation: str = "silu",
        attn_softcap: float = 0.0,
        final_softcap: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.eps = eps
        self.vocab_size = vocab_size
        self.scaling: float = head_dim**-0.5 if scale is None else scale
        self.embed_scale = embed_scale
        """What the embedding's rows are multiplied by (Gemma: sqrt(hidden))."""
        self.attn_softcap = attn_softcap
        """Attention scores become ``cap * tanh(score / cap)`` (0: not; Gemma 2)."""
        self.final_softcap = final_softcap
        """The logits likewise (0: not)."""
        self.activation = activation
        """The MLP gate's: an :attr:`~tserve.gpu.models._architectures.Architecture.activation`."""
        self.embed = embed
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.register_buffer("rope_cos", rope[0], persistent=False)
        self.register_buffer("rope_sin", rope[1], persistent=False)
        local = rope if local_rope is None else local_rope
        # The table of the sliding-window layers (the global one where they share it).
        self.register_buffer("local_rope_cos", local[0], persistent=False)
        self.register_buffer("local_rope_sin", local[1], persistent=False)
        self.ops = ops
        self.decoder: Callable[[torch.Tensor, torch.Tensor, StepMetadata], None] | None = None
        """Every layer of a step in one call, in place on the embeddings (the runner's
        :class:`~tserve.gpu.forward._decoder.FusedDecoder`, or None: one op at a time)."""
        self.progress: np.ndarray | None = None
        """An int64 ``[1]`` counter the layer loop adds one to after each layer
        (the runner's, which its fused decoder counts on too), or None."""

    @classmethod
    def from_hf(cls, model: Any, ops: StepOps = TORCH_OPS) -> PagedLlama:
        """From a Hugging Face model :func:`unsupported_reason` accepts, on its
        device and dtype; the model is not needed afterwards."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"PagedLlama cannot run this model: {reason}")
        config = model.config
        arch = hf_architecture(config.model_type)
        assert arch is not None
        heads = config.num_attention_heads
        decoder = model.model
        windows = hf_layer_windows(config)
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(decoder.layers)
        rotary, positions = decoder.rotary_emb, config.max_position_embeddings
        per_type = isinstance(getattr(rotary, "rope_type", None), dict)  # Gemma 3's two bases

        def table(kind: str | None) -> tuple[torch.Tensor, torch.Tensor]:
            return rope_table(rotary, positions, model.device, model.dtype, kind)

        local = None
        if per_type and "sliding_attention" in types:
            local = table("sliding_attention")
        norm = decoder.norm.weight
        scalar = getattr(config, "query_pre_attn_scalar", None)
        return cls(
            embed=decoder.embed_tokens,  # Gemma's module scales its rows itself
            layers=[
                LayerWeights.from_hf(layer, i, arch, windows[i])
                for i, layer in enumerate(decoder.layers)
            ],
            norm=norm + arch.norm_offset if arch.norm_offset else norm,
            lm_head=model.lm_head,
            rope=table("full_attention" if per_type else None),
            heads=heads,
            kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            eps=config.rms_norm_eps,
            vocab_size=config.vocab_size,
            ops=ops,
            local_rope=local,
            scale=None if scalar is None else scalar**-0.5,
            activation=arch.activation,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) or 0.0,
            final_softcap=getattr(config, "final_logit_softcapping", None) or 0.0,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[len(keep), vocab]`` for the packed rows ``keep``.

        ``input_ids`` and ``positions`` are ``[T]``; writes every token's K/V
        into the pool at ``step.slot_mapping``. Blocks until the device is done
        only where a result must be read back (not here). A step built with
        :class:`~tserve.gpu.forward._attention_step.TokenTables` runs its layers on
        :attr:`decoder` (the runner builds such steps only when it set one).
        """
        residual: torch.Tensor = self.embed(input_ids)  # [T, hidden]; the sums accumulate here
        if self.embed_scale != 1.0:
            residual = residual * self.embed_scale
        if step.token_tables is not None:
            assert self.decoder is not None, "a step by token tables needs a fused decoder"
            self.decoder(residual, positions, step)
            return self._head(residual, None, keep)
        hidden = self._layers(residual, positions, step)
        return self._head(residual, hidden, keep)

    def _layers(
        self, residual: torch.Tensor, positions: torch.Tensor, step: StepMetadata
    ) -> torch.Tensor:
        """Every layer, one op at a time: the last layer's output (not yet added to
        ``residual``, which holds the sums before it). ``decode`` reads this
        layer's ``qkv``, ``k_pool`` and ``v_pool``: it runs inside the layer's
        iteration."""
        ops = self.ops
        tokens = residual.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        hidden: torch.Tensor | None = None
        pool = step.pool

        def decode(group: AttentionGroup, new: Tokens) -> torch.Tensor | None:
            if group.shape[1] != 1 or group.fresh:
                return None  # prefill chunks, and keys that are only this step's: torch
            rows = qkv[slice(*group.packed)] if group.packed else qkv[group.q_index]
            return ops.paged_decode(
                rows, heads, k_pool, v_pool, group.block_tables[kv_group], group.kv_lens,
                group.shape[2], pool.block_size, self.scaling, window, self.attn_softcap,
            )  # fmt: skip

        mlp = ops.gelu_tanh_mul if self.activation == "gelu_tanh" else ops.silu_mul
        for layer in self.layers:
            assert isinstance(layer, LayerWeights)
            window = layer.window
            x = ops.add_rms_norm(residual, hidden, layer.attn_norm, self.eps)
            qkv = layer.qkv(x)  # [T, (heads + 2 kv_heads) * D]
            if layer.qkv_bias is not None:
                qkv.add_(layer.qkv_bias)
            if layer.q_norm is not None:
                self._norm_heads(qkv, layer.q_norm, 0, heads)
                self._norm_heads(qkv, layer.k_norm, heads, kv_heads)
            k_pool, v_pool, kv_group = pool.layer(layer.layer_idx)
            cos, sin = (
                (self.local_rope_cos, self.local_rope_sin)
                if window
                else (self.rope_cos, self.rope_sin)
            )
            slots = step.slot_mapping[kv_group]
            ops.rope_store(qkv, heads, kv_heads, positions, cos, sin, slots, k_pool, v_pool)
            split = qkv.view(tokens, heads + 2 * kv_heads, dim)
            new = Tokens(split[:, :heads], split[:, heads : heads + kv_heads], split[:, -kv_heads:])
            out = attend_groups(
                step.groups, new, k_pool, v_pool, self.scaling, decode, window,
                self.attn_softcap, kv_group,
            )  # fmt: skip
            hidden = layer.o(out.reshape(tokens, heads * dim))
            if layer.post_attn_norm is not None:
                hidden = ops.add_rms_norm(hidden, None, layer.post_attn_norm, self.eps)
            x = ops.add_rms_norm(residual, hidden, layer.mlp_norm, self.eps)
            hidden = layer.down(mlp(layer.gate_up(x)))
            if layer.post_mlp_norm is not None:
                hidden = ops.add_rms_norm(hidden, None, layer.post_mlp_norm, self.eps)
            if self.progress is not None:
                self.progress[0] += 1  # one writer (this thread); an aligned 8-byte store
        assert hidden is not None, "a decoder has at least one layer"
        return hidden

    def _norm_heads(
        self, qkv: torch.Tensor, weight: torch.Tensor | None, first: int, count: int
    ) -> None:
        """Heads ``first .. first + count`` of every row of ``qkv``, each through
        an RMSNorm times ``weight``, in place (on the step's ops, as the fused
        decoder does it)."""
        assert weight is not None, "Q and K heads are normed together"
        dim = self.head_dim
        heads = qkv.view(qkv.shape[0], -1, dim)[:, first : first + count]
        rows = heads.reshape(-1, dim).contiguous()  # a view where one head per row is taken
        normed = self.ops.add_rms_norm(rows, None, weight, self.eps)
        heads.copy_(normed.view_as(heads))

    def _head(
        self, residual: torch.Tensor, hidden: torch.Tensor | None, keep: torch.Tensor
    ) -> torch.Tensor:
        """The last residual add (unless ``hidden`` is None: done), the final norm
        and the output head, on the rows ``keep``."""
        if keep.numel() == 0:
            return residual.new_empty(0, self.vocab_size)
        last = residual.index_select(0, keep)
        tail = None if hidden is None else hidden.index_select(0, keep)
        # On the step's ops like every other norm: the native runner's head is
        # the same C kernel (tserve/gpu/forward/_native.py), so their logits agree bit for bit.
        logits: torch.Tensor = self.lm_head(self.ops.add_rms_norm(last, tail, self.norm, self.eps))
        if self.final_softcap and logits.device.type == "cpu" and logits.dtype == torch.float32:
            soft_cap(logits.numpy(), self.final_softcap)  # the native runner's, in place
        elif self.final_softcap:  # transformers' order: divide, tanh, multiply
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


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


def rope_table(
    rotary: Any,
    positions: int,
    device: torch.device,
    dtype: torch.dtype,
    layer_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, D/2]``, as a transformers rotary module makes them
    (for layers of ``layer_type``, where the module has a table per type).

    That module returns each angle twice (``[..., D]`` is the table
    concatenated with itself); one half is kept.
    """
    probe = torch.empty(0, device=device, dtype=dtype)
    ids = torch.arange(positions, device=device)[None]
    with torch.no_grad():
        cos, sin = rotary(probe, ids) if layer_type is None else rotary(probe, ids, layer_type)
    half = cos.shape[-1] // 2
    return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()
