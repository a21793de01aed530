"""Which parts of a checkpoint each rank loads, on any number of ranks, and the strictness rule.

**World-size rule.** A checkpoint saved by ``W`` ranks loads into ``W'`` ranks, for every
pair, from either kind (``single``: one process, everything in ``rank-00000.pt``; ``dcp``:
several ranks, modules and optimizers in ``dcp/``):

* modules and optimizers (:func:`~ftkit.checkpoint.dcp.sharded_keys`) get the full saved state on every
  rank: from ``dcp/`` through DCP, which reshards into the live layout (replicated models:
  whole tensors on every rank; FSDP/DTensor: each rank's shards), with or without a process
  group; from a ``single`` checkpoint's ``rank-00000.pt`` on every rank as full state dicts,
  sharded where the live model is. Wrapper prefixes (DDP's ``module.``) do not matter.
* everything else is per-rank state (``rank-RRRRR.pt``): a rank ``r < W`` loads its own
  file; a rank ``r >= W`` loads rank 0's state and derives its RNG streams from rank 0's and
  ``r`` (:func:`~ftkit.checkpoint.state.snapshot.derive_rng`); the files of ranks ``W'..W-1`` are not used. Rank 0
  logs the rule once when the sizes differ. :class:`~ftkit.checkpoint.state.sampler.ResumableSampler` translates
  its position into a global one (its ``load_state_dict``).

**Strictness rule.** Every key of the state must be in the checkpoint (as a module or
optimizer in ``dcp/``, or in the rank's file); a missing one is a ``CheckpointError`` naming
the key and the checkpoint, raised before anything is restored, unless the config allows
it (``strict=False``, or the key in ``allow_missing``): then it is left as it is, with a
warning and a ``missing-state`` event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ..config import CheckpointConfig
from ..format.layout import DCP_DIR

__all__ = ["canonical", "check_missing", "describe_rule", "is_dcp", "match_keys", "refusal"]

log = logging.getLogger(__name__)

# what torch's state_dict helpers leave out of a parameter's name (DDP, torch.compile, FSDP1,
# activation checkpointing)
_WRAPPERS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def is_dcp(files: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's modules and optimizers are in ``dcp/`` (several saving ranks)."""
    return f"{DCP_DIR}/.metadata" in files


def check_missing(
    state: Mapping[str, Any],
    available: set[str],
    config: CheckpointConfig,
    path: Path,
    emit: Callable[..., None],
    step: int,
) -> set[str]:
    """The keys of ``state`` not in the checkpoint, allowed by ``config`` (each warned about,
    one ``missing-state`` event); CheckpointError if any is not allowed."""
    missing = [k for k in state if k not in available]
    if not missing:
        return set()
    refused = refusal(state, available, config, path)
    if refused:
        raise CheckpointError(refused)
    for key in missing:
        log.warning("state[%r] (%s) is not in checkpoint %s; left as it is (allowed by %s)",
                    key, _what(state[key]), path,
                    "checkpoint.allow_missing" if key in config.allow_missing else "checkpoint.strict=False")
    emit("missing-state", step=step, path=str(path), keys=missing)
    return set(missing)


def refusal(state: Mapping[str, Any], available: set[str], config: CheckpointConfig, path: Path) -> str:
    """Why :func:`check_missing` refuses the checkpoint (keys of ``state`` it lacks and
    ``config`` does not allow), else "": the ranks agree on it before anything is read into
    the state, since a key only some ranks have would fail only their load."""
    refused = [k for k in state if k not in available and config.strict and k not in config.allow_missing]
    if not refused:
        return ""
    names = ", ".join(f"state[{k!r}] ({_what(state[k])})" for k in refused)
    return (
        f"checkpoint {path} has no {names}; nothing was restored. Resuming would go on with "
        f"{'it' if len(refused) == 1 else 'them'} as initialised, silently. Resume from a "
        "checkpoint that has it, or allow it explicitly: "
        f"CheckpointConfig(allow_missing=({', '.join(repr(k) for k in refused)},)) to leave "
        "these keys as they are, or CheckpointConfig(strict=False) for every key"
    )


def _what(value: Any) -> str:
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def describe_rule(path: Path, saved: int, current: int) -> str:
    """The world-size rule for this load, in words (logged once, by rank 0)."""
    words = [
        f"checkpoint {path} was saved by {saved} rank{'s' if saved != 1 else ''}, this run has "
        f"{current}: modules and optimizers get the full saved state on every rank (resharded "
        "where sharded)"
    ]
    if current > saved:
        extra = (f"rank {saved} loads rank 0's and derives its RNG streams from rank 0's and its rank"
                 if current == saved + 1 else
                 f"ranks {saved}-{current - 1} load rank 0's and derive their RNG streams from rank 0's and their rank")
        own = "rank 0 loads its" if saved == 1 else f"ranks 0-{saved - 1} load their"
        words.append(f"{own} own per-rank state; {extra}")
    else:
        gone = f"rank {current}" if saved == current + 1 else f"ranks {current}-{saved - 1}"
        words.append(
            f"{'rank 0 loads its' if current == 1 else f'ranks 0-{current - 1} load their'} own "
            f"per-rank state; that of {gone} (RNG streams, per-rank values) is not used"
        )
    return "; ".join(words)


def canonical(name: str) -> str:
    """``name`` (a state dict key, a module's name) without the wrappers' parts (``module.`` of DDP,
    ``_orig_mod.`` of torch.compile, FSDP1's and activation checkpointing's): as torch's
    ``state_dict`` helpers name it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def match_keys(saved: Mapping[str, Any], names: list[str], where: str) -> dict[str, Any]:
    """``saved`` (a module's state dict) with each key renamed to the one of ``names`` it
    differs from only by wrapper prefixes (a model saved inside DDP, loaded without it, or the
    reverse). Where the models differ besides (a layer added since), the keys that pair up are
    renamed all the same, so that what does not match is named as the live module names it and
    a non-strict load still gets every layer that is there; the rest stay as they are. As saved
    where the pairing is ambiguous (two names that differ only by wrappers)."""
    if set(saved) == set(names):
        return dict(saved)
    live = {canonical(n): n for n in names}
    renamed = {live.get(canonical(k), k): v for k, v in saved.items()}
    if len(live) == len(names) and len(renamed) == len(saved):
        if set(renamed) != set(names):
            log.debug("%s: saved names do not match the live ones, even without wrapper prefixes", where)
        return renamed
    log.debug("%s: saved names pair up with the live ones in more than one way", where)
    return dict(saved)
