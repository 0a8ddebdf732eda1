"""Experiment trackers: WriteMLflow and WriteWandb send a run's config, its epoch variables, its
step loss and its end (finished, failed, interrupted) to MLflow or Weights & Biases.

Both packages are optional: a config that names a tracker whose package is missing is an error
naming what to install. Only the main process writes. The tracker's run id is part of the
checkpoint, so a resumed run continues the same tracker run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from phalanx.config import flat_keys
from phalanx.errors import ConfigError, first_line, named
from phalanx.hooks.variables import flat_variables
from phalanx.hooks.writers import _Writer

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from wandb.sdk.wandb_run import Run

log = logging.getLogger("phalanx")


def _require(module: str, install: str, hook: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{hook} needs the {module} package, which is not installed: pip install {install} "
            f"(or remove {hook} from hooks)"
        )


class _Tracker(_Writer):
    """What the trackers share: the run id kept in checkpoints, the step loss every N steps."""

    gathers = False

    def __init__(self, every_n_steps: int = 50):
        self.every = every_n_steps
        self.run_id: str | None = None  # the tracker's run, continued on resume
        self._started = False

    def reads_loss(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def _config(self) -> dict[str, Any]:
        from phalanx import rundir

        return rundir.resolved(self.trainer.cfg)

    def before_training(self) -> None:
        """Start (or continue) the tracker's run: a failure here is a one-line error, before
        training."""
        if not self.active:
            return
        try:
            self._start(resumed=self.run_id is not None)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a tracker's errors (network, database, login) vary
            raise ConfigError(
                f"{type(self).__name__}: the tracker could not start a run "
                f"({named(e, 300)}); check its settings, or remove the "
                "hook"
            ) from e
        self._started = True

    def after_batch(self, stream: str, batch: dict[str, Any]) -> None:
        step = self.trainer.step
        due = self.every and step % self.every == 0
        if not (self._started and self.trainer.training and due):
            return
        # a training step has set it; read only when logged
        loss = self.trainer.last_loss
        if loss is not None:
            values = {"train.step_loss": float(loss)}
            if self.trainer.last_grad_norm is not None:
                values["train.step_grad_norm"] = self.trainer.last_grad_norm
            values.update(
                {f"lr.group{i}": lr for i, lr in enumerate(self.trainer.learning_rates())}
            )
            self._safely(self._log, values, step)

    def after_epoch(self, epoch: int, epoch_data: dict) -> None:
        if self._started:
            self._safely(
                self._log, {"epoch": float(epoch), **flat_variables(epoch_data)}, self.trainer.step
            )

    def after_training(self, success: bool) -> None:
        if self._started:
            status = (
                "finished"
                if success
                else "interrupted"
                if self.trainer.stop_requested
                else "failed"
            )
            self._safely(self._end, status)
            self._started = False

    def _safely(self, call: Any, *args: Any) -> None:
        """A tracker that fails once training runs (a network hiccup, a locked database) is said
        once and left; the training goes on, and metrics.csv and the logs hold everything."""
        try:
            call(*args)
        except Exception as e:  # noqa: BLE001 - the tracker's own errors, whatever they are
            self._started = False
            log.error(
                "%s: the tracker failed (%s); training goes on without it",
                type(self).__name__,
                named(e, 300),
            )

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    @property
    def _run_id(self) -> str:
        """The tracker's run id, which a started tracker has."""
        if self.run_id is None:
            raise RuntimeError(f"{type(self).__name__}: the tracker's run has not started")
        return self.run_id

    def _start(self, resumed: bool) -> None:
        raise NotImplementedError

    def _log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _end(self, status: str) -> None:
        raise NotImplementedError


# how long a tracking server has to answer at the start, before training
FIRST_CONTACT_S = 10


def _answers(uri: str) -> None:
    """A tracking server named by an http(s) `uri` accepts connections, within seconds: MLflow's
    own retries would hold the start for minutes where nothing listens."""
    from urllib.parse import urlsplit

    where = urlsplit(uri)
    if where.scheme not in ("http", "https") or not where.hostname:
        return
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        socket.create_connection((where.hostname, port), timeout=FIRST_CONTACT_S).close()
    except OSError as e:
        raise ConfigError(
            f"WriteMLflow: nothing answers at {where.hostname}:{port} (tracking_uri {uri}: "
            f"{e.strerror or type(e).__name__}); start the tracking server, correct tracking_uri, "
            "or remove the hook"
        ) from None


@contextlib.contextmanager
def _bounded_http():
    """MLflow's HTTP calls while its run starts: one try each, `FIRST_CONTACT_S` long (MLflow's
    defaults retry for minutes), unless the user set these variables."""
    import os

    bounds = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(FIRST_CONTACT_S),
    }
    added = {key: value for key, value in bounds.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class WriteMLflow(_Tracker):
    """An MLflow run per phalanx run: the resolved config as parameters and as `config.yaml`, every
    epoch variable and the step loss (every `every_n_steps`) as metrics at the optimizer step, the
    run directory as a tag, and the end as FINISHED, FAILED or KILLED.

    `tracking_uri`: where MLflow stores runs; default MLFLOW_TRACKING_URI where set, else the local
    database `<output_root>/mlflow.db`, with artifacts in `<output_root>/mlartifacts` (look at them
    with `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`, where the mlflow package is
    installed).
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "phalanx",
        run_name: str | None = None,
        every_n_steps: int = 50,
    ):
        _require("mlflow", "mlflow-skinny sqlalchemy alembic (or mlflow)", "WriteMLflow")
        super().__init__(every_n_steps)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self._client: MlflowClient | None = None

    @property
    def _started_client(self) -> MlflowClient:
        """The client of the MLflow run that `_start` began."""
        if self._client is None:
            raise RuntimeError("WriteMLflow: the MLflow run has not started")
        return self._client

    def _start(self, resumed: bool) -> None:
        import os

        from mlflow import MlflowClient

        uri = (
            self.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{Path(self.trainer.cfg.output_root).resolve() / 'mlflow.db'}"
        )
        with _bounded_http():
            self._begin(MlflowClient(tracking_uri=uri), uri, resumed)

    def _begin(self, client: Any, uri: str, resumed: bool) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        _answers(uri)
        self._client = client
        if resumed:
            try:
                client.update_run(self.run_id, status="RUNNING")
                log.info("WriteMLflow: continuing MLflow run %s in %s", self.run_id, uri)
                return
            except MlflowException as e:
                log.warning(
                    "WriteMLflow: the run's MLflow run %s is not in %s (%s); starting a new one",
                    self.run_id,
                    uri,
                    str(e).splitlines()[0],
                )
        experiment = client.get_experiment_by_name(self.experiment)
        # a local database keeps the experiment's artifacts beside it (MLflow's default: ./mlruns,
        # wherever that is)
        local = (
            Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts"
            if uri.startswith("sqlite:///")
            else None
        )
        experiment_id = (
            experiment.experiment_id
            if experiment
            else client.create_experiment(
                self.experiment, artifact_location=local.as_uri() if local else None
            )
        )
        run_dir = self._run_dir
        run = client.create_run(
            experiment_id,
            run_name=self.run_name or run_dir.name,
            tags={"phalanx.run_dir": str(run_dir.resolve())},
        )
        self.run_id = run.info.run_id
        config = self._config()
        params = [Param(key, str(value)[:6000]) for key, value in flat_keys(config).items()]
        try:
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                client.log_batch(self.run_id, params=params[i : i + 100])
            client.log_dict(self.run_id, config, "config.yaml")
        except Exception:
            client.set_terminated(self.run_id, status="FAILED")  # not left RUNNING
            raise
        log.info("WriteMLflow: MLflow run %s in %s", self.run_id, uri)

    def _log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), 1000):
            self._started_client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def _end(self, status: str) -> None:
        self._started_client.set_terminated(
            self._run_id,
            status={"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}[status],
        )


class WriteWandb(_Tracker):
    """A Weights & Biases run per phalanx run: the resolved config, every epoch variable (as
    `stream/variable`) and the step loss (every `every_n_steps`) at the optimizer step, and the
    end (exit code 0, or 1, marked preempted where a signal stopped it). Its files go to the run
    directory's `wandb/`.

    `mode`: online, offline (files only; `wandb sync` uploads them later) or disabled; default
    W&B's own choice (WANDB_MODE, else online). W&B's own process writes the files and closes them
    just after the run ends, without being waited for: the last records of an offline run can
    reach its file a moment after `fit` returns.
    """

    def __init__(
        self,
        project: str = "phalanx",
        entity: str | None = None,
        name: str | None = None,
        mode: Literal["online", "offline", "disabled"] | None = None,
        tags: list[str] | None = None,
        every_n_steps: int = 50,
    ):
        _require("wandb", "wandb", "WriteWandb")
        if mode not in (None, "online", "offline", "disabled"):
            raise ConfigError(f"WriteWandb: mode {mode!r} is not online, offline or disabled")
        super().__init__(every_n_steps)
        self.project, self.entity, self.name, self.mode, self.tags = (
            project,
            entity,
            name,
            mode,
            tags,
        )
        self._run: Run | None = None

    @property
    def _started_run(self) -> Run:
        """The W&B run that `_start` began."""
        if self._run is None:
            raise RuntimeError("WriteWandb: the W&B run has not started")
        return self._run

    def _start(self, resumed: bool) -> None:
        import wandb

        run_dir = self._run_dir
        try:
            run = wandb.init(
                project=self.project,
                entity=self.entity,
                name=self.name or run_dir.name,
                mode=self.mode,
                tags=self.tags,
                dir=str(run_dir),
                config=self._config(),
                id=self.run_id,
                resume="allow" if resumed else None,
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as e:  # noqa: BLE001 - W&B's errors (no API key, no network) vary by version
            raise ConfigError(
                f"WriteWandb: W&B could not start a run ({first_line(e, 300)}); "
                "log in with `wandb login`, "
                "or write the run's files only with mode: offline (`wandb sync` uploads them later)"
            ) from e
        self._run, self.run_id = run, run.id
        log.info("WriteWandb: W&B run %s (%s), files in %s", run.id, run.settings.mode, run.dir)

    def _log(self, values: dict[str, float], step: int) -> None:
        # `stream/variable`: W&B groups its charts by the part before the slash (a dot would nest
        # the key)
        self._started_run.log(
            {name.replace(".", "/", 1): value for name, value in values.items()}, step=step
        )

    def _end(self, status: str) -> None:
        run = self._started_run
        if status == "interrupted":
            run.mark_preempting()
        run.finish(exit_code=0 if status == "finished" else 1)
