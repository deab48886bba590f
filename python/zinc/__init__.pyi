# Type stubs of the package zinc (the engine lives in zinc._zinc, C++).
import os
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, overload

import numpy as np
import numpy.typing as npt

from . import optim as optim

__version__: str

Config = Union[Mapping[str, Any], str, "os.PathLike[str]"]
"""A zinc experiment: a DeepSpeed config dict plus the model, data, run and comm
sections, or the path of a JSON file holding one."""

Tokens = npt.NDArray[np.int32]
"""A C-contiguous int32 array of shape (B, T)."""

Batch = Union[Tuple[Tokens, Tokens], Sequence[Tokens], Mapping[str, Tokens]]
"""(inputs, targets), or {"inputs": ..., "targets": ...}."""

Event = Dict[str, Any]
"""One of zinc-train --json's events: {"event": "config" | "auto" | "step" | "eval" | "checkpoint" | "summary", ...}."""

class Error(RuntimeError):
    """An error from zinc's engine."""

class ConfigError(ValueError):
    """A wrong config value; .path is its JSON path ("" when not about one value)."""

    path: str

class CommError(Error):
    """A collective between ranks that failed."""

class Engine:
    """A training engine over a built-in model (see help(zinc.Engine)).

    One call at a time: a call while another thread is inside one on the same
    engine raises RuntimeError; close() then marks it closed and the running
    call frees it when it returns.
    """

    @overload
    def forward(self, batch: Optional[Batch] = None) -> float: ...
    @overload
    def forward(self, inputs: Tokens, targets: Tokens, positions: Optional[Tokens] = None) -> float: ...
    def backward(self, loss: Optional[float] = None) -> None: ...
    def step(self) -> None: ...
    def train_batch(self, data: Optional[Iterable[Batch]] = None) -> float: ...
    @overload
    def evaluate(self, batch: Optional[Batch] = None) -> float: ...
    @overload
    def evaluate(self, inputs: Tokens, targets: Tokens, positions: Optional[Tokens] = None) -> float: ...
    def save_checkpoint(
        self, save_dir: str, tag: Union[str, int, None] = None, client_state: Optional[Dict[str, Any]] = None
    ) -> None: ...
    def save_pretrained(
        self, save_dir: str, dtype: Optional[str] = None, max_shard_size: str = "5GB", merge: bool = False
    ) -> Dict[str, Any]: ...
    def save_adapter(self, save_dir: str) -> Dict[str, Any]: ...
    def load_checkpoint(self, load_dir: str, tag: Union[str, int, None] = None) -> Dict[str, Any]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Engine": ...
    def __exit__(self, *exc: Any) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def global_steps(self) -> int: ...
    @property
    def skipped_steps(self) -> int: ...
    @property
    def micro_steps(self) -> int: ...
    @property
    def learning_rate(self) -> float: ...
    @property
    def grad_norm(self) -> float: ...
    @property
    def last_loss(self) -> float: ...
    @property
    def loss_scale(self) -> float: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def num_parameters(self) -> int: ...
    @property
    def config(self) -> Dict[str, Any]: ...

def initialize(config: Config) -> Engine: ...
@overload
def train(
    config: Config, steps: Optional[int] = None, on_step: None = None, *, ignore_resources: bool = False
) -> Iterator[Event]: ...
@overload
def train(
    config: Config, steps: Optional[int] = None, *, on_step: Callable[[Event], Any], ignore_resources: bool = False
) -> Event: ...
@overload
def train(
    config: Config, steps: Optional[int], on_step: Callable[[Event], Any], *, ignore_resources: bool = False
) -> Event: ...
