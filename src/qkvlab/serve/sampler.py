"""The next token of each sequence from its logits: greedy, temperature/top-k/top-p with its own seeded
generator, presence and frequency penalties, and log-probabilities.

- greedy and seeded sampling are `qkvlab.decode.generate.next_token`'s, row by row, so a sequence's
  tokens are what `generate` gives it alone at the same seed;
- penalties as OpenAI defines them and vLLM applies them: over the tokens the sequence has produced
  (not the prompt), logit - presence * [count > 0] - frequency * count, before temperature;
- log-probabilities of the model's own distribution (before penalties, temperature and filtering:
  vLLM's default `raw_logprobs`), over the ids the tokenizer has.
"""

from __future__ import annotations

import torch

from qkvlab.decode.sampling import Sampling, next_token
from qkvlab.serve.request import Sequence, TopK


class Sampler:
    def __init__(self, vocab_limit: int | None = None):
        self.vocab_limit = vocab_limit

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
        """logits (B, V) of seqs -> each one's next token (None: sampling failed for that one)."""
        tokens: list[int | None] = next_token(logits, Sampling(temperature=0.0), vocab_limit=self.vocab_limit).tolist()
        for j, s in enumerate(seqs):
            req = s.request
            penalized = req.presence_penalty or req.frequency_penalty
            if req.sampling.greedy and not penalized:
                continue
            row = self.penalize(logits[j : j + 1], s) if penalized else logits[j : j + 1]
            try:
                tokens[j] = int(next_token(row, req.sampling, s.generator, self.vocab_limit)[0])
            except RuntimeError:  # e.g. a temperature so small the probabilities overflow: this one only
                tokens[j] = None
        return tokens

    @staticmethod
    def penalize(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """logits (1, V) less the sequence's presence and frequency penalties."""
        if not seq.counts:
            return logits
        ids = torch.tensor(list(seq.counts), device=logits.device)
        counts = torch.tensor(list(seq.counts.values()), dtype=logits.dtype, device=logits.device)
        req = seq.request
        out = logits.clone()
        out[0, ids] -= req.presence_penalty + req.frequency_penalty * counts
        return out

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[list[float], list[TopK]]:
        """logits (B, V), tokens (B,) -> each token's log-probability and the k most probable."""
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits = logits[..., : self.vocab_limit]
        lp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)  # bf16 would round them
        chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()
        if k == 0:
            return chosen, [() for _ in chosen]
        values, ids = lp.topk(min(k, lp.shape[-1]), -1)
        return chosen, [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

    def prompt_logprobs(self, logits: torch.Tensor, seq: Sequence, start: int) -> None:
        """logits (count, V) after the prompt's tokens [start, start + count) -> seq.prompt_lp extended
        with the (logprob, top) of each following prompt token (the prompt's first token has none)."""
        if start == 0:
            seq.prompt_lp = [(None, None)]
        nxt = seq.tokens[start + 1 : min(start + 1 + logits.shape[0], seq.prompt_len)]
        if not nxt:
            return
        ids = torch.tensor(nxt, device=logits.device)
        chosen, top = self.logprobs(logits[: len(nxt)], ids, seq.request.prompt_logprobs)
        seq.prompt_lp += list(zip(chosen, top))
