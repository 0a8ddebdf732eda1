"""The state of a model split into stages over processes (the pipeline's): each process holds its
stages' part of the model and of the optimizer, under the whole model's names. The whole state is
gathered to the main process from the first copy of the pipeline (its parameters numbered as in the
whole model), a whole state is loaded by each process for its part, and a checkpoint's shards are
written and read by each process for its stages alone."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from phalanx.errors import CheckpointMismatch, ConfigError


class StageState:
    """Shared members of a strategy whose processes each hold some of the model's stages: its
    model's and optimizer's state as a checkpoint holds them, whole, in the whole model's names."""

    model: nn.Module
    mine: list[int]  # this process's stages
    data_rank: int  # its copy of the pipeline
    tensor_rank: int  # its place in its stages' tensor group (0: none)
    # the whole model's state (names and shapes), its trainable parameters' count, and each of this
    # process's trainable parameters' index among them
    _whole: dict[str, tuple[int, ...]]
    _trainable: int
    _global_index: list[int]
    progress: Any

    if TYPE_CHECKING:  # the process group's

        @property
        def is_main(self) -> bool: ...

        def gather(self, value: Any) -> list[Any]: ...

    def _keep_stages(self, whole: nn.Module, keep: Callable[[nn.Module], None]) -> list[str]:
        """This process's stages kept of the whole model (`keep` removes the others' modules), and
        what the state needs of the whole: its state's names and shapes, its trainable parameters'
        count, and each kept trainable parameter's index among them. Returns the kept trainable
        parameters that are another's alias in the whole model (a tied weight) and that stage
        does not hold: a split the state cannot name."""
        trainable = [n for n, p in whole.named_parameters() if p.requires_grad]
        first = {id(p): n for n, p in whole.named_parameters()}
        aliases = {
            n: first[id(p)]
            for n, p in whole.named_parameters(remove_duplicate=False)
            if first[id(p)] != n
        }
        self._trainable = len(trainable)
        self._whole = {k: tuple(v.shape) for k, v in whole.state_dict().items()}
        keep(whole)
        mine = [n for n, p in whole.named_parameters() if p.requires_grad]
        index = {name: i for i, name in enumerate(trainable)}
        self._global_index = [index[n] for n in mine if n in index]
        return [f"{n} is {aliases[n]}" for n in mine if n not in index and n in aliases]

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state on the main process, each stage's part gathered from the first
        copy of the pipeline."""
        mine = None
        if self.data_rank == 0:
            # a tensor group's processes put their split layers back together (a collective of
            # the group); its first gives them
            state = {k: _to_cpu(v) for k, v in self.model.state_dict().items()}
            mine = state if self.tensor_rank == 0 else None
        self.progress.enter("the gathering of the stages' states")
        parts = self.gather(mine)
        if not self.is_main:
            return {}
        whole: dict[str, torch.Tensor] = {}
        for part in parts:
            whole.update(part or {})
        return whole

    def load_model_state(self, path: Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        from safetensors.torch import load_file

        from phalanx.checkpoint import SHARDS
        from phalanx.shards import load_shards

        if path.name == SHARDS:  # each process reads its stages' part
            load_shards(path, self.model, optimizer, whole=self._whole)
            return
        try:
            missing, unexpected = self.load_state(load_file(str(path)))
        except RuntimeError as e:
            raise CheckpointMismatch(f"{path} does not fit stages {self.mine}: {e}") from None
        if missing or unexpected:
            raise CheckpointMismatch(
                f"{path} holds another model (it lacks {missing[:3]}, the model lacks "
                f"{unexpected[:3]})"
            )

    def load_state(self, state: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Each process keeps its stages' part; what is missing or unexpected is judged against
        the whole model."""
        mine = self.model.state_dict()
        given = {k: _placed(v, mine[k]) for k, v in state.items() if k in mine}
        self.model.load_state_dict(given, strict=False)
        missing = [k for k in self._whole if k not in state]
        return missing, [k for k in state if k not in self._whole]

    def save_shards(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """Each process writes its stages' part of the model and optimizer state, in the model's
        own names (a stage's copies hold the same: it is written once); no process gathers the
        whole model."""
        from phalanx.shards import save_shards

        self.progress.enter("the saving of the checkpoint's shards")
        save_shards(folder, self.model, optimizer)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole optimizer's state, parameters numbered as in the whole model, on the main
        process."""
        state = optimizer.state_dict()
        mine = None
        if self.data_rank == 0:
            mine = {
                "state": {
                    self._global_index[i]: tree_map(_to_cpu, s) for i, s in state["state"].items()
                },
                "param_groups": state["param_groups"],
            }
            mine = mine if self.tensor_rank == 0 else None
        self.progress.enter("the gathering of the stages' optimizer states")
        parts = self.gather(mine)
        if not self.is_main:
            return {}
        merged: dict[int, Any] = {}
        for part in parts:
            if part:
                merged.update(part["state"])
        groups = [dict(g, params=list(range(self._trainable))) for g in state["param_groups"]]
        if len(groups) != 1:
            raise ConfigError("the pipeline strategy saves optimizers of one parameter group")
        return {"state": merged, "param_groups": groups}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        local = {g: i for i, g in enumerate(self._global_index)}
        params = optimizer.param_groups[0]["params"]
        mine = {
            "state": {
                local[int(g)]: {k: _placed(v, params[local[int(g)]]) for k, v in s.items()}
                for g, s in state["state"].items()
                if int(g) in local
            },
            "param_groups": [
                dict(group, params=list(range(len(self._global_index))))
                for group in state["param_groups"]
            ],
        }
        optimizer.load_state_dict(mine)


def _to_cpu(value: Any) -> Any:
    """A tensor on the host; a split one (a DTensor) whole, from its group (a collective)."""
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().cpu()


def _placed(value: Any, like: Any) -> Any:
    """A whole tensor of `like`'s shape split as `like` (a DTensor) is, each process slicing its
    part from its own copy (no communication); anything else as it is."""
    if not hasattr(like, "device_mesh") or not isinstance(value, torch.Tensor):
        return value
    if value.shape != like.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(like.device, like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
