"""ConvertConfig: what `qkvlab convert` reads. The steps it configures: Hugging Face import
(convert/hf.py), an exact change of basis (convert/reparam.py), export back to transformers."""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.base.devices import EXACT_DTYPES, dtype_choices
from qkvlab.base.errors import UserError
from qkvlab.base.settings import check, setting
from qkvlab.convert.reparam import DEFAULT_MAX_COND

HF_CLASSES = ("gpt2", "llama", "deepseek")  # deepseek: DeepseekV3ForCausalLM, for MLA models


@dataclass
class ConvertConfig:
    input: str = setting(
        help="qkvlab model folder (or, with --from-hf, a transformers folder or .gguf)", positional=True, metavar="IN"
    )
    output: str = setting(
        help="folder to write (a new or empty one, or a model with --overwrite)", positional=True, metavar="OUT"
    )
    overwrite: bool = setting(False, help="replace OUT if it already holds a model")
    to: str | None = setting(
        None, help="target scheme, e.g. Id-K-V (remove W_Q), Q-Id-V (remove W_K), Q-K-V (insert)", metavar="SCHEME"
    )
    layer: int | None = setting(None, help="remove the projection of layer L only (theorem a)", metavar="L")
    from_hf: bool = setting(False, help="IN is a Hugging Face GPT-2/Llama folder or a .gguf file")
    to_hf: str | None = setting(None, help="write a transformers checkpoint of this class", choices=HF_CLASSES)
    to_gguf: bool = setting(
        False, help="write OUT as a llama.cpp GGUF file (F32; llama, or deepseek2 for an MLA model)"
    )
    gguf_vocab: str | None = setting(
        None,
        help="the GGUF whose tokenizer a --to-gguf file carries (required unless IN is that GGUF: a path a model folder records is never opened)",
        metavar="FILE",
    )
    llama_bin: str | None = setting(
        None,
        help="llama.cpp's bin/ folder: --to-gguf checks the file with its llama-completion (default: $QKVLAB_LLAMA_BIN, "
        "else the PATH's)",
        metavar="DIR",
    )
    dtype: str | None = setting(
        None,
        help="dtype of the result (default: the input's, fp32 or fp64)",
        choices=dtype_choices(EXACT_DTYPES, auto=False),
    )
    max_cond: float = setting(
        DEFAULT_MAX_COND, help="refuse a W_Q/W_K whose condition number exceeds X", metavar="X", positive=True
    )

    def validate(self) -> ConvertConfig:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        if not (self.to or self.from_hf or self.to_hf or self.to_gguf):
            raise UserError("nothing to do: give --to SCHEME, --from-hf, --to-hf gpt2|llama|deepseek or --to-gguf")
        if self.to_gguf and (self.to_hf or not self.output.endswith(".gguf")):
            raise UserError(f"--to-gguf writes one file: OUT={self.output!r} must end in .gguf (and no --to-hf)")
        if self.gguf_vocab is not None and not self.to_gguf:
            raise UserError("--gguf-vocab is for --to-gguf")
        if self.llama_bin is not None and not self.to_gguf:
            raise UserError("--llama-bin is for --to-gguf")
        if self.layer is not None and not self.to:
            raise UserError("--layer needs --to SCHEME")
        return self
