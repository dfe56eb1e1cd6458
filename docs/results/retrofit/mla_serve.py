"""Does `qkvlab serve` hold the MLA saving? Each model is served with one --cache-memory; the tokens its paged
cache admits are read from serve's own start-up line (vLLM's "KV cache size: N tokens"), and one greedy chat
request is answered through the HTTP surface, so the figure belongs to a server that works.

    python docs/results/retrofit/mla_serve.py NAME=MODEL [NAME=MODEL ...] [--cache-memory 1GiB] [--dtype fp32] [--out FILE.json]

The first model is the reference: every other one's `tokens_ratio` is its admitted tokens over the first's.
OUT (default: printed only) is refused when it exists.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from qkvlab.base.files import atomic_write, json_text

STARTUP = re.compile(
    r"http://(?P<host>[^/]+)/v1 serving (?P<name>\S+) .*? KV cache size: (?P<tokens>[\d,]+) tokens \((?P<per>[\d,]+) bytes per token"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def serve_once(model: str, cache_memory: str, dtype: str, timeout: float = 600.0) -> dict:
    """Start `qkvlab serve MODEL`, read its start-up line, ask one greedy chat question, stop it."""
    cmd = [
        sys.executable,
        "-m",
        "qkvlab",
        "serve",
        model,
        "--port",
        "0",
        "--cache-memory",
        cache_memory,
        "--dtype",
        dtype,
    ]
    errors = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        start, line = time.monotonic(), ""
        while time.monotonic() - start < timeout:
            line = proc.stdout.readline()
            if not line or STARTUP.search(line):
                break
        found = STARTUP.search(line)
        if found is None:
            errors.seek(0)
            said = (errors.read().strip().splitlines() or ["nothing"])[-1]
            raise SystemExit(f"mla_serve: {model}: serve printed no start-up line (exit {proc.poll()}): {said}")
        body = json.dumps({"model": found["name"], "messages": QUESTION, "max_tokens": 16, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://{found['host']}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                answer = json.loads(reply.read())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as e:
            raise SystemExit(f"mla_serve: {model}: the chat request got {e.code}: {e.read().decode()[:300]}") from None
        return {
            "tokens": int(found["tokens"].replace(",", "")),
            "bytes_per_token": int(found["per"].replace(",", "")),
            "startup_line": line.strip(),
            "answer": answer,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        errors.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="NAME=MODEL (a qkvlab folder or a .gguf); the first is the reference")
    p.add_argument("--cache-memory", default="1GiB")
    p.add_argument(
        "--dtype", default="fp32", help="serve's --dtype, the same for every model (auto may differ by model)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.out is not None and args.out.exists():
        raise SystemExit(f"mla_serve: {args.out} exists; choose another --out")
    pairs = [m.split("=", 1) for m in args.models]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit("mla_serve: give each model as NAME=MODEL")
    runs = {name: {"model": model, **serve_once(model, args.cache_memory, args.dtype)} for name, model in pairs}
    first = runs[pairs[0][0]]["tokens"]
    for run in runs.values():
        run["tokens_ratio"] = round(run["tokens"] / first, 4)
    report = {"cache_memory": args.cache_memory, "dtype": args.dtype, "runs": runs}
    for name, run in runs.items():
        print(f"{name}: {run['tokens']:,} tokens ({run['bytes_per_token']:,} B/token), x{run['tokens_ratio']:.3f}; "
              f"answer {run['answer']!r}")  # fmt: skip
    if args.out is not None:
        atomic_write(args.out, json_text(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
