"""Fixtures of the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tserve.gpu.kernels._library import isa_cap, kernel_library


@pytest.fixture(params=[0, 1, 2], ids=["portable", "avx2", "avx512"])
def glue_isa(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each variant of the fp32 glue loops (``_glue.h``'s GLUE_ENTRY) this CPU
    runs, capped to it as ``TSERVE_MAX_ISA`` caps them; the cap restored after."""
    library = kernel_library()
    assert library is not None, "the package is installed, so its kernels are built"
    library.tserve_set_isa_cap(isa_cap())
    if library.tserve_glue_isa() < request.param:
        pytest.skip("this CPU has no such variant")
    library.tserve_set_isa_cap(request.param)
    try:
        assert library.tserve_glue_isa() == request.param
        yield request.param
    finally:
        library.tserve_set_isa_cap(isa_cap())
