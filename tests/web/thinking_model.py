"""A tiny thinking model whose greedy output is known: ``<think>REASONING</think>ANSWER``.

The tiny Llama's layers are silenced (every attention output and MLP down
projection is zero), so the last hidden state is the current token's
embedding alone: the model is a bigram table. Its embedding gives each token
of a chain its own axis and its output head maps each to the next, so greedy
decoding from the generation prompt's last token walks the chain:
``<think>``, the reasoning's tokens, ``</think>``, the answer's tokens, eos.
Tokens off the chain (what a grammar forces) get small random logits.

The tokenizer gains ``<think>`` and ``</think>`` as added tokens that are not
special (so decoding keeps them, as Qwen3's and DeepSeek-R1's do), and a
Qwen3-style template: it mentions ``<think>``, and with ``enable_thinking``
false it writes ``<think>\\n\\n</think>`` after the generation prompt, whose
last token, ``</think>``, leads straight to the answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

REASONING: Final = "The quick brown fox"
ANSWER: Final = "Hello, world!"

TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>' }}{% endif %}{% endif %}"
)


def build_thinking_model(directory: Path) -> Path:
    """Write the model into ``directory`` (a tiny model is built there first); return it."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tserve.gpu.models._directory import build_tiny_model

    build_tiny_model(directory, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    tokenizer.chat_template = TEMPLATE
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    start = tokenizer.encode(prompt, add_special_tokens=False)[-1]
    think = tokenizer.convert_tokens_to_ids("<think>")
    end = tokenizer.convert_tokens_to_ids("</think>")
    chain = [
        start,
        think,
        *tokenizer.encode(REASONING, add_special_tokens=False),
        end,
        *tokenizer.encode(ANSWER, add_special_tokens=False),
        tokenizer.eos_token_id,
    ]
    links = chain[:-1]
    assert len(set(links)) == len(links), "a token twice in the chain would make it a loop"
    hidden = model.config.hidden_size
    assert len(links) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        generator = torch.Generator().manual_seed(0)
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.copy_(torch.randn(head.shape, generator=generator) * 0.01)
        for axis, (token, following) in enumerate(zip(links, chain[1:], strict=True)):
            embed[token] = 0.0
            embed[token, axis] = 1.0
            head[following, axis] = 10.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
