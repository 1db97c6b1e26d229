"""What a checkpoint holds, keyed by name: the model's state dict and the optimizer's state.

Keys: ``model.<state dict key>`` for the model; ``optim.state.<parameter name>.<state key>`` for
optimizer state (``exp_avg``, ``step``, ...). Parameters are named as in
``model.named_parameters()``, never by their position in the optimizer, so a checkpoint loads
into a model built in another order or on another mesh. Hyper-parameters of each param group
are kept with the names of the group's parameters.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch
import torch.nn as nn

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..placement import Replicate
from ..tensor import DTensor
from .index import CheckpointIndex, check_json, dtype_name, parse_dtype

MODEL = "model."
OPTIM = "optim.state."
_GROUP_SKIP = ("params", "param_names")


@attrs.frozen
class SavedState:
    """What ``save`` writes: tensors by key, JSON values by key, the optimizer's groups/state map."""

    tensors: dict  # key -> torch.Tensor (a DTensor or a plain tensor)
    values: dict  # key -> JSON value (non-tensor optimizer state)
    optimizer: dict | None  # {"param_groups": [...], "state": {param name: [state keys]}}


@attrs.frozen
class LoadTargets:
    """Where ``load`` puts each key, and what to do once the data is in."""

    tensors: dict  # key -> destination tensor (model tensors, or new/reused optimizer state)
    finish: Callable[[], None]  # installs optimizer state and hyper-parameters


def model_key(name: str) -> str:
    return MODEL + name


def optim_key(param: str, state: str) -> str:
    return f"{OPTIM}{param}.{state}"


def model_tensors(model: nn.Module) -> dict:
    """``model.<key>`` -> the model's own tensor (not a detached copy) for every state-dict entry."""
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"model state {name!r} is a {type(value).__name__}, not a tensor; dtorch checkpoints hold "
                "tensors (save it in `extra=` instead)"
            )
        out[model_key(name)] = value
    return out


def parameter_names(model: nn.Module, optimizer) -> dict:
    """id(parameter) -> name for every parameter the optimizer holds; each must be in the model."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"param group {i} of the optimizer holds a parameter of shape {tuple(p.shape)} that is "
                    "not a parameter of the model; checkpoints name optimizer state by parameter name"
                )
    return names


def encode_value(value: Any, what: str) -> Any:
    """A hyper-parameter or state value as JSON (tensors as ``{"tensor": values, "dtype": name}``)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()  # a scalar-sized hyper-parameter: reading it is cheap
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "dtype": dtype_name(value.dtype)}
    if isinstance(value, tuple):
        value = list(value)
    check_json(value, what)
    return value


def decode_value(value: Any, current: Any = None) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=parse_dtype(value["dtype"]))
    if isinstance(value, list) and isinstance(current, tuple):
        return tuple(value)
    return value


def collect(model: nn.Module, optimizer) -> SavedState:
    """The state to save from ``model`` and (unless None) ``optimizer``."""
    tensors = model_tensors(model)
    values = {}
    if optimizer is None:
        return SavedState(tensors, values, None)
    names = parameter_names(model, optimizer)
    groups = []
    state_keys = {}
    for i, group in enumerate(optimizer.param_groups):
        hyper = {k: encode_value(v, f"param group {i} {k!r}") for k, v in group.items() if k not in _GROUP_SKIP}
        hyper["params"] = [names[id(p)] for p in group["params"]]
        groups.append(hyper)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            name = names[id(p)]
            state_keys[name] = list(state)
            for k, v in state.items():
                key = optim_key(name, k)
                if isinstance(v, torch.Tensor):
                    tensors[key] = v
                else:
                    values[key] = encode_value(v, f"optimizer state {key!r}")
    return SavedState(tensors, values, {"param_groups": groups, "state": state_keys})


def _mismatch(key: str, entry, tensor: torch.Tensor) -> str | None:
    diffs = []
    if tuple(entry.shape) != tuple(tensor.shape):
        diffs.append(f"shape {tuple(entry.shape)} in the checkpoint, {tuple(tensor.shape)} here")
    if entry.dtype != tensor.dtype:
        diffs.append(f"dtype {dtype_name(entry.dtype)} in the checkpoint, {dtype_name(tensor.dtype)} here")
    return "; ".join(diffs) or None


def _new_state_tensor(entry, param: torch.Tensor) -> torch.Tensor:
    """A destination for saved optimizer state: laid out like its parameter when it has the
    parameter's shape (exp_avg, ...), else replicated on the parameter's mesh or plain."""
    with torch.no_grad():
        if entry.distributed and isinstance(param, DTensor):
            if tuple(entry.shape) == tuple(param.shape):
                return torch.empty_like(param, dtype=entry.dtype)
            from ..api import empty

            mesh = param.device_mesh
            return empty(entry.shape, device_mesh=mesh, placements=[Replicate()] * mesh.ndim, dtype=entry.dtype)
        device = "cpu" if isinstance(param, DTensor) else param.device
        return torch.empty(entry.shape, dtype=entry.dtype, device=device)


def _raise_mismatch(missing, unexpected, mismatched) -> None:
    parts = []
    if missing:
        parts.append(f"missing keys (in the model/optimizer, not in the checkpoint): {sorted(missing)}")
    if unexpected:
        parts.append(f"unexpected keys (in the checkpoint, not in the model/optimizer): {sorted(unexpected)}")
    if mismatched:
        parts.append("mismatched: " + "; ".join(f"{k}: {v}" for k, v in sorted(mismatched.items())))
    raise CheckpointMismatchError(
        "the checkpoint does not fit this model: " + ". ".join(parts)
        + ". Load it into the model it was saved from (same parameter names, shapes and dtypes)",
        missing=sorted(missing), unexpected=sorted(unexpected), mismatched=mismatched,
    )


def plan_load(model: nn.Module, optimizer, index: CheckpointIndex) -> LoadTargets:
    """Destinations for every key of ``index``; raises CheckpointMismatchError (naming the
    missing, unexpected and mismatched keys) before anything is changed or allocated."""
    dests = model_tensors(model)
    saved_model = {k for k in index.tensors if k.startswith(MODEL)}
    missing = set(dests) - saved_model
    unexpected = saved_model - set(dests)
    mismatched = {}
    for key in set(dests) & saved_model:
        why = _mismatch(key, index.tensors[key], dests[key])
        if why:
            mismatched[key] = why
    if optimizer is not None:
        _check_optimizer(model, optimizer, index, missing, unexpected)
    if missing or unexpected or mismatched:
        _raise_mismatch(missing, unexpected, mismatched)
    finish = _no_finish if optimizer is None else _optimizer_targets(model, optimizer, index, dests)
    return LoadTargets(dests, finish)


def _no_finish() -> None:
    pass


def _check_optimizer(model, optimizer, index, missing: set, unexpected: set) -> None:
    """Add the optimizer's parameters the checkpoint lacks (and the reverse), group by group."""
    if index.optimizer is None:
        missing.add("optim.param_groups")
        return
    names = parameter_names(model, optimizer)
    saved_groups = index.optimizer["param_groups"]
    groups = optimizer.param_groups
    missing.update(f"optim.param_groups[{i}]" for i in range(len(saved_groups), len(groups)))
    unexpected.update(f"optim.param_groups[{i}]" for i in range(len(groups), len(saved_groups)))
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        here = {names[id(p)] for p in group["params"]}
        there = set(saved["params"])
        missing.update(f"optim.param_groups[{i}].{n}" for n in here - there)
        unexpected.update(f"optim.param_groups[{i}].{n}" for n in there - here)


def _decode(value: Any, current: Any, key: str) -> Any:
    try:
        return decode_value(value, current)
    except CheckpointError:
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError, RecursionError) as exc:
        raise CheckpointCorruptError(f"the checkpoint index is damaged: the value of {key!r} cannot be read "
                                     f"({type(exc).__name__}: {exc}); load another checkpoint", entry=key) from None


def _check_state_tensor(key: str, entry, limit: int, reusable: bool) -> None:
    """A saved optimizer tensor may not be larger than all the optimizer's parameters together
    (unless the optimizer holds one of that very shape already): checked before allocating it."""
    if not reusable and math.prod(entry.shape) > limit:
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer state {key!r} has shape {tuple(entry.shape)}: more elements than "
            f"all {limit} of the optimizer's parameters together, so not state of this optimizer. Load the "
            "checkpoint into the model and optimizer it was saved from", mismatched={key: f"shape {tuple(entry.shape)}"},
        )


def _optimizer_targets(model, optimizer, index, dests: dict) -> Callable[[], None]:
    """Add a destination per saved optimizer tensor to ``dests``; return what installs the new
    state and the saved hyper-parameters once the data is in. Everything is checked (names,
    values, sizes against the parameters) before the first destination is allocated."""
    names = parameter_names(model, optimizer)
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    limit = max(1, sum(p.numel() for p in by_name.values()))
    hyper = [{k: _decode(v, group.get(k), f"optim.param_groups[{i}].{k}") for k, v in saved.items() if k not in _GROUP_SKIP}
             for i, (group, saved) in enumerate(zip(optimizer.param_groups, index.optimizer["param_groups"]))]
    plan = {}  # parameter -> {state key: its decoded value, or a _Pending tensor}
    for name, keys in index.optimizer["state"].items():
        if name not in by_name:
            raise CheckpointCorruptError(
                f"the checkpoint index is damaged: it holds optimizer state of {name!r}, which is in none of "
                "its param groups; load another checkpoint", entry=f"{OPTIM}{name}",
            )
        p = by_name[name]
        current = optimizer.state.get(p, {})
        state = {}
        for k in keys:
            key = optim_key(name, k)
            if key in index.values:
                state[k] = _decode(index.values[key], current.get(k), key)
                continue
            if key not in index.tensors:
                raise CheckpointCorruptError(
                    f"the checkpoint index is damaged: it lists optimizer state {key!r} but holds no value "
                    "for it; load another checkpoint", entry=key,
                )
            entry = index.tensors[key]
            old = current.get(k)
            reuse = (isinstance(old, torch.Tensor) and tuple(old.shape) == tuple(entry.shape)
                     and old.dtype == entry.dtype and isinstance(old, DTensor) == entry.distributed)
            _check_state_tensor(key, entry, limit, reuse)
            state[k] = _Pending(key, entry, old if reuse else None)  # reuse: keep the optimizer's layout
        plan[p] = state
    new_state = {}
    for p, state in plan.items():
        new_state[p] = {}
        for k, v in state.items():
            if isinstance(v, _Pending):
                dests[v.key] = v.reuse if v.reuse is not None else _new_state_tensor(v.entry, p)
                v = dests[v.key]
            new_state[p][k] = v

    def finish() -> None:
        for group, values in zip(optimizer.param_groups, hyper):
            group.update(values)
        for p in by_name.values():
            if p in new_state:
                optimizer.state[p] = new_state[p]
            else:
                optimizer.state.pop(p, None)

    return finish


@attrs.frozen
class _Pending:
    """A saved optimizer tensor whose destination is made once every check has passed."""

    key: str
    entry: Any
    reuse: Any  # the optimizer's own tensor of that shape and dtype, or None
