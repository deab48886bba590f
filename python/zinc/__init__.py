"""zinc: a ZeRO training engine (DeepSpeed's config, CPU ranks under MPI).

    import zinc
    engine = zinc.initialize("configs/default.json")   # or a dict
    for _ in range(20):
        loss = engine.train_batch()                    # the config's data
    engine.save_checkpoint("ckpt")

    for event in zinc.train("configs/default.json", steps=20):
        print(event)                                   # zinc-train --json's events

    opt = zinc.optim.AdamW(lr=1e-3)                    # zinc's AdamW kernels on NumPy arrays
    opt.step(1, param, grad, exp_avg, exp_avg_sq)      # in place

    import zinc.torch                                  # where torch is installed
    opt = zinc.torch.CPUAdamW(model.parameters())      # DeepSpeedCPUAdam's arguments

Errors: zinc.ConfigError (a ValueError, with .path) for a wrong config value,
OSError for files, zinc.CommError between ranks, zinc.Error otherwise; a bad
argument is a TypeError or ValueError naming it.
"""

import atexit as _atexit

from ._zinc import (  # noqa: F401
    CommError,
    ConfigError,
    Engine,
    Error,
    __version__,
    initialize,
)
from . import _zinc
from . import optim

__all__ = ["CommError", "ConfigError", "Engine", "Error", "__version__", "initialize", "optim", "train"]


def _events(config, steps, ignore_resources=False):
    run = _zinc._TrainRun(config, steps, ignore_resources)
    try:
        yield from run.start()
        while True:
            events = run.step()  # a Ctrl-C during the step is raised here, between steps
            if events is None:
                break
            yield from events
        yield run.summary()
    finally:
        run.engine.close()


def train(config, steps=None, on_step=None, *, ignore_resources=False):
    """Runs the experiment a config describes, as ``zinc-train CONFIG --json`` does.

    config: a dict or a path to a JSON file (see zinc.initialize). steps: the
    number of optimizer steps (run.steps when None), as ``--steps``.

    Without on_step, returns a generator of the run's events as dicts, the
    objects zinc-train --json prints one per line: "config", "auto" (when
    the config has "auto" values), "step" (every steps_per_print steps and
    at the last step), "eval", "checkpoint", and a final "summary" (whose
    process-wide figures, such as peak RSS and communication shares, only
    zinc-train reports). The engine is built at the first next(). Under
    mpirun every rank yields the same events.

    With on_step, calls on_step(event) for every event and returns the
    summary event.

    A Ctrl-C stops the run at a step boundary with KeyboardInterrupt; a run
    with run.checkpoint_interval > 0 first saves the step under way and
    yields its events, as zinc-train saves on a signal.

    As zinc-train, a run whose estimated RAM exceeds what this host grants
    (cgroup limit, MemAvailable), or whose NVMe or checkpoint files exceed
    their disk's free space, is refused at the start with zinc.Error naming
    the need and the limit; ignore_resources=True skips that check.
    """
    events = _events(config, steps, ignore_resources)
    if on_step is None:
        return events
    summary = None
    for event in events:
        on_step(event)
        summary = event
    return summary


_atexit.register(_zinc._shutdown)
