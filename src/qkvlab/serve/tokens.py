"""The served model's tokenizer behind one interface, whichever library owns it.

- a transformers tokenizer (an HF folder, a GGUF's, or one `convert --from-hf` carried into a
  qkvlab folder's tokenizer/): special tokens in text are tokens (`<|im_start|>` is one id, as
  transformers and vLLM encode it), the chat template is the tokenizer's own and is rendered by
  transformers' `apply_chat_template`, and the stop ids are vLLM's: the tokenizer's eos_token_id
  and the eos_token_id(s) of generation_config.json beside it;
- a qkvlab tokenizer (bpe, char, gpt2, bytes): no special tokens beyond its end of text, no chat
  template of its own.

`--chat-template FILE` (vLLM's option) sets or replaces the template of either kind; a qkvlab
tokenizer's is rendered by the same Jinja renderer transformers' apply_chat_template uses.

`encode` may take seconds on a megabyte prompt: the app calls it on a worker thread, and both kinds
encode through an API that releases the GIL while it works (transformers' batch call, qkvlab's
`encode_batch`: the Rust tokenizers and tiktoken), so the event loop answers meanwhile.
`max_chars_per_token` bounds the text a token covers (the longest token's UTF-8 bytes), so a prompt
too long for the context is refused before any tokenizing (serve/prompts.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from qkvlab.base.errors import UserError


class ServeTokenizer:
    def __init__(self, name: str, vocab_size: int, stop_ids: Sequence[int], chat_template: str | None = None):
        self.name, self.vocab_size = name, vocab_size
        self.stop_ids = frozenset(stop_ids)
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """At least the characters of text any one token covers: its text's UTF-8 bytes (a character
        is one byte or more; a token holding part of a character decodes to U+FFFD, 3 bytes)."""
        return max((len(t.encode("utf-8")) for t in self.token_texts()), default=1) or 1

    def token_texts(self) -> list[str]:
        return [self.token_text(i) for i in range(self.vocab_size)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def token_text(self, token: int) -> str:
        """One token as text (logprobs' `tokens`): special tokens spelled out."""
        return self.decode([token], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.chat_template is None:
            raise UserError("this model has no chat template: use /v1/completions (or serve it with --chat-template)")
        try:
            return self._render(messages, add_generation_prompt, **kwargs)
        except Exception as e:  # the template's own checks (jinja's raise_exception) and its errors
            raise UserError(f"the chat template refused these messages: {str(e).splitlines()[0][:200]}") from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            [messages], chat_template=self.chat_template, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return rendered[0]


class QkvlabTokenizer(ServeTokenizer):
    """A qkvlab tokenizer (data/tokenizer.py): its end of text is the one stop id."""

    def __init__(self, tok):
        super().__init__(tok.name, tok.vocab_size, [] if tok.eot_id is None else [tok.eot_id])
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        batch = getattr(self.tok, "encode_batch", None)  # the Rust/tiktoken batch call releases the GIL
        return batch([text])[0] if batch is not None else self.tok.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids))


class HFTokenizer(ServeTokenizer):
    """A transformers tokenizer. `folder`: where it was read from (its generation_config.json)."""

    def __init__(self, tok, folder: Path | None = None):
        stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        stops |= generation_eos(folder)
        super().__init__(Path(getattr(tok, "name_or_path", "") or "hf").name, len(tok), sorted(stops))
        self.chat_template = tok.chat_template if isinstance(tok.chat_template, str) else None
        self.tok = tok
        self.eot_id = tok.eos_token_id  # where `qkvlab generate` stops (serve stops at any of stop_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the __call__ path encodes through the Rust batch API, which releases the GIL (encode() does not)
        return self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self) -> list[str]:
        return self.tok.batch_decode([[i] for i in range(self.vocab_size)], skip_special_tokens=False)

    def _render(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
        return self.tok.apply_chat_template(
            messages,
            chat_template=self.chat_template,  # the tokenizer's, or --chat-template's
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )


def generation_eos(folder: Path | None) -> set[int]:
    """eos_token_id (an id or a list) of generation_config.json in `folder`: the end-of-turn ids a
    model's authors set for generation (e.g. Llama 3's <|eot_id|> beside <|end_of_text|>)."""
    if folder is None or not (folder / "generation_config.json").is_file():
        return set()
    try:
        eos = json.loads((folder / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    eos = eos if isinstance(eos, list) else [eos]
    return {e for e in eos if isinstance(e, int) and not isinstance(e, bool)}


def serve_tokenizer(tok, folder: Path | None = None) -> ServeTokenizer | None:
    """Wrap what convert/load.py's `load_any` returned (None: the model has no tokenizer)."""
    if tok is None:
        return None
    if hasattr(tok, "apply_chat_template"):
        return HFTokenizer(tok, folder)
    return QkvlabTokenizer(tok)
