"""zinc.optim: zinc's CPU optimizers, in place on NumPy arrays (see help(zinc.optim.AdamW))."""

from ._zinc import optim as _optim

AdamW = _optim.AdamW
isa = _optim.isa

__all__ = ["AdamW", "isa"]
