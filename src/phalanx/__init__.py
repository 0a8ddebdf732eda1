"""phalanx: train any PyTorch model on one device, many devices or many machines from a YAML config.

From Python: `phalanx.fit(config, model=..., dataset=..., hooks=[...])` trains and returns the run;
`phalanx.resume(run_dir)` continues one; `phalanx.load(run_dir)` gives its trained model back;
`phalanx.evaluate` and `phalanx.predict` run a checkpoint on a stream.
"""

__version__ = "0.1.0"
__all__ = ["Run", "evaluate", "fit", "load", "predict", "resume"]


def __getattr__(name: str):
    # imported on first use: `phalanx --version` and `--help` need no torch
    if name in __all__:
        from phalanx import api

        return getattr(api, name)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
