"""A model directory's optional JSON files, read the same way by both processes.

The engine reads ``generation_config.json`` (``gpu/models/_sampling_defaults.py``),
the API process ``tokenizer_config.json`` and ``special_tokens_map.json``
(``nursery/_tokenizer_files.py``). A leaf: the standard library only, so
either side may import it. Blocking (a small file read).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["read_json_object"]


def read_json_object(path: Path, error: Callable[[str], Exception]) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` where there is no such file.

    Raises ``error(message)`` where the file cannot be read, is not JSON, or
    holds something other than an object (the message names ``path``).
    """
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise error(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{path} does not hold a JSON object")
    return data
