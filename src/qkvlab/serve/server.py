"""ServeConfig, the capacity it buys, and uvicorn with a drain on SIGTERM.

The model is whatever convert/load.py's one loader reads (a qkvlab folder or run, a Hugging Face
folder, a .gguf), with its own tokenizer (serve/tokens.py), served as it is.

Capacity: the cache is one pool of blocks of --block-size tokens (paged.py), so
    capacity (tokens) = cache memory // (KV-cache bytes per token x block size) x block size
with bytes per token from the projection spec (accounting.kv_cache_bytes_per_token: Q-K=V caches
one tensor where Q-K-V caches two, MQA one head where MHA caches n_head). It must hold one whole
context (--max-model-len, default the model's); capacity / context is vLLM's "maximum
concurrency". --max-batch caps the sequences decoded at once.

Drain: the first SIGTERM (or Ctrl-C) stops admitting (new requests get 503, /health says
"draining"), lets running and queued requests finish for up to --drain-timeout seconds, ends the
rest, then stops the server with exit status 0. A second signal stops at once.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkvlab.base.devices import (
    DEVICE_HELP,
    check_device,
    compile_mode,
    compile_setting,
    dtype_name,
    inference_dtype_setting,
)
from qkvlab.base.errors import UserError
from qkvlab.base.settings import check, setting
from qkvlab.base.units import byte_size, nbytes
from qkvlab.serve.kv_cache_manager import blocks_for, default_block_size


@dataclass
class ServeConfig:
    """What `qkvlab serve` runs; usable from Python: `build(cfg, load_served(cfg))`."""

    model: str = setting(
        help="a qkvlab model folder (or run), a Hugging Face folder or a .gguf file", positional=True, metavar="MODEL"
    )
    host: str = setting("127.0.0.1", help="address to listen on (loopback unless you say otherwise)")
    port: int = setting(8000, help="TCP port (0: any free port, printed at start-up)", minimum=0, maximum=65535)
    cache_memory: str = setting(
        "1GiB", help="KV-cache memory: the pool of cache blocks, e.g. 512MB, 8GiB or bytes", metavar="SIZE"
    )
    block_size: int | None = setting(
        None,
        help="tokens per cache block (default: 64 on the CPU, where the in-place read pays per block; 16, vLLM's "
        "default, elsewhere)",
        minimum=1,
        maximum=4096,
    )
    max_batch: int | None = setting(None, help="most sequences at once (default: all the cache blocks hold)", minimum=1)
    max_num_batched_tokens: int = setting(
        512,
        help="tokens one step computes at most (vLLM's name): a long prompt is prefilled in chunks of what is "
        "left beside the decoding streams; smaller keeps their pace, larger starts long prompts sooner",
        minimum=1,
    )
    prefix_caching: bool = setting(
        True, help="reuse the cached blocks of a prompt prefix served before (vLLM's automatic prefix caching)"
    )
    device: str = setting("auto", help=DEVICE_HELP, metavar="DEVICE")
    dtype: str = inference_dtype_setting()
    tokenizer: str | None = setting(
        None,
        help="tokenizer instead of the model's own: gpt2, bytes, or a folder (qkvlab's or transformers' files)",
        metavar="gpt2|bytes|DIR",
    )
    chat_template: str | None = setting(
        None, help="a Jinja chat template file, instead of the tokenizer's (or for a model without one)", metavar="FILE"
    )
    max_model_len: int | None = setting(
        None, help="longest sequence served, prompt and output (default: the model's context)", minimum=1
    )
    name: str | None = setting(None, help="model name clients send (default: the folder's name)")
    drain_timeout: float = setting(30.0, help="seconds running requests may take to finish after SIGTERM", minimum=0)
    compile: str = compile_setting(
        "auto",
        "torch.compile the decode step with this mode before listening (symbolic shapes; on the CPU inductor's "
        "C++ wrapper; bare --compile: default): faster steps for a minute or more of compiling at start-up. "
        "auto: off, as measured on the CPU only (docs/serve.md); reduce-overhead (CUDA graphs) is refused: "
        "the batch changes every step",
    )

    def validate(self) -> ServeConfig:
        check(self)  # types, choices and bounds of every field; below: what the declarations cannot say
        check_device(self.device)
        compile_mode(self.compile, "cpu", paged=True)  # reduce-overhead refused before any weight is read
        dtype_name(self.dtype)
        self.cache_bytes  # noqa: B018 (checks the size)
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise UserError(f"--chat-template {self.chat_template}: no such file")
        return self

    @property
    def cache_bytes(self) -> int:
        return byte_size(self.cache_memory, "--cache-memory")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pool_blocks(cache_bytes: int, bytes_per_token: int, context: int, block_size: int) -> int:
    """Blocks of block_size tokens that fit in cache_bytes; refuses a pool without one whole context."""
    per_block = bytes_per_token * block_size
    blocks = cache_bytes // per_block
    if blocks < blocks_for(context, block_size):
        need = blocks_for(context, block_size) * per_block
        raise UserError(
            f"--cache-memory of {cache_bytes:,} bytes holds no sequence: one of the context's {context:,} tokens "
            f"needs {need:,} bytes ({bytes_per_token:,} bytes per token, blocks of {block_size}); "
            "raise --cache-memory or lower --max-model-len"
        )
    return blocks


@dataclass
class Weights:
    """A model ready to serve (`load_served`): on its device in the chosen dtype, its tokenizer as served,
    the longest sequence served, and the decoding choices it was loaded with."""

    model: Any
    tokenizer: Any  # serve.tokens.ServeTokenizer, or None: prompts are token ids
    context: int  # --max-model-len, or the model's context
    decoding: Any  # serve.decoding.RunnerDecoding
    device: Any  # torch.device


@dataclass
class Built:
    app: Any
    engine: Any
    served: Any
    device: str
    dtype: str
    dtype_probe: Any = None  # the dtype_probe.Decision when `auto` was measured (the CPU), else None


def load_served(cfg: ServeConfig) -> Weights:
    """`cfg` checked, the model and its tokenizer read, the decoding choices made once (the dtype: auto
    on the CPU is this model's decode step timed or cached at one row and at the rows served together,
    --max-batch up to LAYOUT_MAX_BATCH, its default counted as that many; the layout for those rows),
    and the model in that dtype on its device."""
    # startup: torch, the model and the decoding choices, only once a server is built (`--help` stays light)
    from qkvlab.base.devices import select_device, torch_dtype
    from qkvlab.convert.load import load_any
    from qkvlab.decode.choices import decode_choices
    from qkvlab.decode.layout import LAYOUT_MAX_BATCH
    from qkvlab.serve.decoding import runner_decoding

    cfg.validate()
    device = select_device(cfg.device)  # before the weights are read: a bad --device costs nothing
    loaded = load_any(cfg.model, cfg.tokenizer)
    tok = served_tokenizer(loaded, cfg.chat_template)
    context = served_context(loaded.cfg.context, cfg.max_model_len)
    rows = min(cfg.max_batch or LAYOUT_MAX_BATCH, LAYOUT_MAX_BATCH)
    choices = decode_choices(loaded.cfg, device=device, dtype=cfg.dtype, batch=rows, batches=(1, rows))
    model = loaded.model.to(device=device, dtype=torch_dtype(choices.dtype, device.type)).eval()
    decoding = runner_decoding(model, choices, compile_mode(cfg.compile, device.type, paged=True))
    return Weights(model, tok, context, decoding, device)


def build(cfg: ServeConfig, weights: Weights, log: Callable[[str], None] = lambda s: None) -> Built:
    """The engine and app for `cfg` serving `weights` (`load_served(cfg)`), no thread started, no port
    bound: the pool sized, what the runner compiles compiled; `log` gets a line for that, and one saying
    what `--dtype auto` resolved to and why when it was measured (the CPU)."""
    # startup: the engine and the app, only once a server is built
    from qkvlab.model.accounting import kv_cache_bytes_per_token
    from qkvlab.model.limits import check_fits
    from qkvlab.serve.app import create_app
    from qkvlab.serve.async_engine import AsyncEngine
    from qkvlab.serve.engine import Engine
    from qkvlab.serve.served import ServedModel

    model, tok, decoding = weights.model, weights.tokenizer, weights.decoding
    per_token = kv_cache_bytes_per_token(model.cfg, decoding.choices.dtype)
    block_size = cfg.block_size or default_block_size(weights.device.type)
    blocks = pool_blocks(cfg.cache_bytes, per_token, weights.context, block_size)
    check_fits(blocks * block_size * per_token, "--cache-memory", "lower --cache-memory", weights.device)
    name = cfg.name or Path(cfg.model).resolve().name.removesuffix(".gguf")
    metrics = prometheus_metrics(name)
    stops = tok.stop_ids if tok is not None else ()
    engine = Engine(model, cfg.max_batch, blocks=blocks, block_size=block_size, stop_ids=stops,
                    vocab_limit=getattr(tok, "vocab_size", None), context=weights.context, metrics=metrics,
                    choices=decoding, token_budget=cfg.max_num_batched_tokens, prefix_caching=cfg.prefix_caching)  # fmt: skip
    probe = decoding.choices.dtype_decision
    if probe is not None:  # once built: a refusal stays one line
        log(f"qkvlab serve: {probe.describe()}")
    seconds = engine.warm_up()
    if seconds:
        what = "decode step" if decoding.compiled else "paged read"
        log(f"qkvlab serve: compiled the {what} in {seconds:.1f} s ({decoding.paged_read})")
    served = ServedModel(name, scheme_text(model.cfg), weights.context, per_token, engine.runner.store.bytes_allocated(),
                         tok, decoding.report())  # fmt: skip
    app = create_app(AsyncEngine(engine), served, metrics=metrics)
    return Built(app, engine, served, str(weights.device), decoding.choices.dtype, probe)


def served_tokenizer(loaded, chat_template: str | None):
    """The model's tokenizer as served (tokens.ServeTokenizer, or None), with --chat-template's
    template; refused when it has more ids than the model."""
    from qkvlab.serve.tokens import serve_tokenizer  # startup: transformers' tokenizer types, once built

    tok = serve_tokenizer(loaded.tokenizer, loaded.tokenizer_dir)
    if chat_template is not None:
        if tok is None:
            raise UserError("--chat-template needs a tokenizer: the model has none; give --tokenizer")
        try:
            tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"--chat-template {chat_template}: {e.strerror}") from None
    if tok is not None and tok.vocab_size > loaded.cfg.vocab_size:
        raise UserError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocabulary is {loaded.cfg.vocab_size}"
        )
    if tok is not None:
        tok.max_chars_per_token  # noqa: B018 (measured here, not on the first request)
    return tok


def served_context(model_context: int, max_model_len: int | None) -> int:
    context = model_context if max_model_len is None else max_model_len
    if context > model_context:
        raise UserError(f"--max-model-len {context:,} exceeds the model's context of {model_context:,}")
    return context


def scheme_text(model_cfg) -> str:
    """The scheme as /health names it: the latent and per-layer schemes, and kv heads when fewer."""
    heads = f", kv heads {model_cfg.n_kv_heads}" if model_cfg.n_kv_heads != model_cfg.n_head else ""
    return model_cfg.scheme_label + heads


def prometheus_metrics(name: str):
    """Prometheus metrics (serve/metrics.py), or None without prometheus_client (GET /metrics then says so)."""
    try:
        import prometheus_client  # noqa: F401  # optional: prometheus_client
    except ImportError:
        return None
    from qkvlab.serve.metrics import Metrics  # startup: only once a server is built

    return Metrics(name)


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: the system picks a free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host!r}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def make_server(built: Built, sock: socket.socket, drain_timeout: float, log=print):
    """A uvicorn server for `built` on `sock` whose SIGTERM drains the engine first."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # uvicorn's signal handler
            if built.engine.draining:  # a second signal: stop now
                self.should_exit = self.force_exit = True
                return
            self.begin_drain(f"signal {signal.Signals(sig).name}")

        def begin_drain(self, why: str) -> threading.Thread:
            built.engine.begin_drain()
            log(f"qkvlab serve: {why}: draining ({built.engine.stats()['active']} running, up to {drain_timeout:g} s)")
            t = threading.Thread(target=self._drain, name="qkvlab-drain", daemon=True)
            t.start()
            return t

        def _drain(self) -> None:
            if not built.engine.wait_idle(drain_timeout):
                log("qkvlab serve: drain timed out: ending the requests still running")
                built.engine.abort_all("shutdown")
                built.engine.wait_idle(10.0)
            self.should_exit = True

    config = uvicorn.Config(
        built.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
    )
    return DrainingServer(config)


def serve(cfg: ServeConfig) -> int:
    """Run `qkvlab serve` until SIGTERM/Ctrl-C: one start-up line, then requests."""
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    built = build(cfg, load_served(cfg), log=log)
    sock = listen(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    served, engine = built.served, built.engine
    print(  # vLLM's terms: the cache in tokens, the concurrency at full-length requests
        f"qkvlab serve: http://{host if ':' not in host else f'[{host}]'}:{port}/v1 serving {served.name} "
        f"({served.scheme}, {built.dtype} on {built.device}): capacity {engine.capacity_sequences:,} sequences of "
        f"{served.context:,} tokens; KV cache size: {engine.kv.tokens:,} tokens "
        f"({served.cache_bytes_per_token:,} bytes per token, {nbytes(served.cache_bytes)}), "
        f"maximum concurrency {engine.max_concurrency:.2f}x",
        flush=True,
    )
    built.engine.start()
    try:
        make_server(built, sock, cfg.drain_timeout, log=log).run(sockets=[sock])
    finally:
        built.engine.stop()
        sock.close()
    print("qkvlab serve: stopped", file=sys.stderr, flush=True)
    return 0
