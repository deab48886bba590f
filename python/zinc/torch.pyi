# Type stubs of zinc.torch (importable only where torch is).
from typing import Sequence, Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

class CPUAdamW(torch.optim.Optimizer):
    """AdamW on CPU float32 tensors with zinc's kernels; DeepSpeedCPUAdam's arguments."""

    fp32_optimizer_states: bool
    def __init__(
        self,
        model_params: Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None: ...
    def step(  # type: ignore[override]
        self, closure: Optional[Callable[[], Any]] = None, fp16_param_groups: Optional[Sequence[Sequence[Any]]] = None
    ) -> Optional[Any]: ...
