"""``python -m slideformer``: the CLI, as torchrun launches it (``torchrun --nproc-per-node N -m slideformer train``)."""
from .cli import entry

raise SystemExit(entry())
