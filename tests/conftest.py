import os

import pytest
import torch

# Triton kernels run in its interpreter on the CPU; the variable must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# ``@triton.jit`` reads the variable when a kernel module is imported: import ours now, not first inside
# a test that has unset it (that made the interpreted tests fail whenever a subset of files ran).
import slideformer.kernels  # noqa: E402,F401

try:  # Liger's kernels too: its RoPE runs in the interpreter (its SwiGLU does not)
    import liger_kernel.ops.swiglu  # noqa: F401
    import liger_kernel.transformers.rope  # noqa: F401
except ImportError:
    pass

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _interpreter_only_where_marked(request, monkeypatch):
    """The interpreter costs ~1 ms per program: kernel tests (and tests marked ``interpret``) use it,
    the rest (whole demo runs) take the kernels' PyTorch path, which is what a CPU user gets."""
    if "interpret" not in request.keywords and request.module.__name__ != "test_kernels":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
