"""Random sentences of a grammar, token by token, as a model under its mask would write them.

llguidance masks each step; a seeded random choice among the allowed tokens
stands in for a model (a garbage model: anything the grammar allows).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from tokenizers import Tokenizer


class Walker:
    """Sentences of Lark grammars over one model directory's tokenizer."""

    def __init__(self, model_dir: Path, eos_token: str = "<|im_end|>") -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.eos = self.tokenizer.token_to_id(eos_token)
        text = (model_dir / "tokenizer.json").read_text()
        self.ll = LLTokenizer(text, eos_token=self.eos)

    def tokens(self, lark: str, seed: int, max_tokens: int = 400) -> list[int]:
        """Token ids of one random sentence, EOS excluded; at most ``max_tokens``."""
        grammar = LLMatcher.grammar_from_lark(lark)
        matcher = LLMatcher(self.ll, grammar)
        assert not matcher.is_error(), matcher.get_error()
        rng = random.Random(seed)
        mask = allocate_token_bitmask(1, self.ll.vocab_size)
        out: list[int] = []
        while not matcher.is_stopped() and len(out) < max_tokens:
            fill_next_token_bitmask(matcher, mask, 0)
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: self.ll.vocab_size]
            token = int(rng.choice(np.nonzero(bits)[0].tolist()))
            assert matcher.consume_token(token), matcher.get_error()
            if token == self.eos:
                break
            out.append(token)
        return out

    def text(self, lark: str, seed: int, max_tokens: int = 400) -> str:
        return str(self.tokenizer.decode(self.tokens(lark, seed, max_tokens)))
