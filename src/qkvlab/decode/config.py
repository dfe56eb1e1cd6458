"""GenerateConfig: what `qkvlab generate` reads. The decoding it configures is qkvlab.decode.generate
(`stream`, `generate`), its choices qkvlab.decode.choices, its sampling qkvlab.decode.sampling; the
tokenizer comes from qkvlab.data.tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from qkvlab.base.devices import DEVICE_HELP, check_device, compile_setting, inference_dtype_setting
from qkvlab.base.errors import UserError
from qkvlab.base.settings import check, seed_setting, setting
from qkvlab.decode.sampling import Sampling


@dataclass
class GenerateConfig:
    model_dir: str = setting(
        help="model folder (config.json + model.safetensors)", positional=True, metavar="MODEL_DIR"
    )
    prompt: tuple[str, ...] | None = setting(None, help="prompt text (repeat for a batch)", metavar="TEXT")
    prompt_ids: tuple[str, ...] | None = setting(
        None, help="prompt as token ids, e.g. '1,2,3' (repeatable)", metavar="IDS"
    )
    max_new_tokens: int = setting(100, help="tokens to generate per prompt", metavar="N", minimum=1)
    temperature: float = setting(0.8, help="0 = greedy", minimum=0)
    top_k: int = setting(0, help="keep the K most likely tokens (0 = off)", metavar="K", minimum=0)
    top_p: float = setting(1.0, help="nucleus sampling mass in (0, 1] (1 = off)", metavar="P", positive=True, maximum=1)
    seed: int | None = seed_setting(None, help="seed for sampling (default: random)")
    tokenizer: str | None = setting(None, help="tokenizer when the model folder records none", metavar="gpt2|bytes|DIR")
    device: str = setting("auto", help=DEVICE_HELP, metavar="DEVICE")
    dtype: str = inference_dtype_setting()
    compile: str = compile_setting(
        "auto",
        "torch.compile the static decode step with this mode (bare --compile: default). auto: "
        "reduce-overhead (CUDA graphs) on a GPU, off on a CPU, where compiling takes longer than it saves "
        "in one run (docs/inference.md)",
    )

    def validate(self) -> GenerateConfig:
        check(self)  # types, choices and bounds of every field; below: the rules across fields
        if (self.prompt is None) == (self.prompt_ids is None):
            raise UserError("give the prompt as --prompt TEXT or as --prompt-ids IDS (one of the two)")
        if self.prompt is not None and not all(text for text in self.prompt):
            raise UserError("empty prompt: give at least one character to start from")
        check_device(self.device)
        return self

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p).validate()

    def prompt_token_ids(self) -> list[list[int]]:
        """--prompt-ids as lists of ints."""
        rows = []
        for ids in self.prompt_ids or ():
            try:
                rows.append([int(t) for t in ids.replace(",", " ").split()])
            except ValueError:
                raise UserError(f"--prompt-ids {ids!r} must be integers separated by commas or spaces") from None
        return rows
