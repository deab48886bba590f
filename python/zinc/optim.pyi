from typing import Optional, Tuple

import numpy as np
import numpy.typing as npt

class AdamW:
    """AdamW / Adam (adamw_mode=False) with zinc's kernels, in place on NumPy arrays.

    lr, eps, weight_decay and step's grad_scale must be finite and >= 0, betas
    in [0, 1): ValueError naming the argument otherwise.
    """

    def __init__(
        self,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        adamw_mode: bool = True,
    ) -> None: ...
    def step(
        self,
        step: int,
        param: npt.NDArray[np.float32],
        grad: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
        exp_avg: npt.NDArray[np.float32],
        exp_avg_sq: npt.NDArray[np.float32],
        *,
        bf16_out: Optional[npt.NDArray[np.uint16]] = None,
        grad_scale: float = 1.0,
    ) -> None: ...
    lr: float
    @property
    def betas(self) -> Tuple[float, float]: ...
    @property
    def eps(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def bias_correction(self) -> bool: ...
    @property
    def adamw_mode(self) -> bool: ...

def isa() -> str: ...
