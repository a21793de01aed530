"""The checkpoint format: names in the root, the manifest, the one commit protocol, retention, pins.

Pure file work, no torch: ``ftkit ls``/``verify``/``status``, ``ftkit requeue`` and the Hugging
Face integration use it without importing torch. Data flows one way: ``layout`` (names) <-
``manifest`` (the commit proof and validation) <- ``retention`` / ``pins`` <- ``commit`` (the
lifecycle of a step directory, which every write path goes through). See docs/format.md for the
format as a spec and docs/architecture.md for where this sits.
"""

from __future__ import annotations

from .commit import Committer, delete, mark_incomplete, retain, seal
from .layout import (
    LATEST,
    MANIFEST,
    PIN,
    SENTINEL,
    list_step_dirs,
    parse_hf_step,
    parse_step,
    rank_file,
    step_name,
)
from .manifest import read_manifest, validate_dir
from .pins import pin_checkpoint, unpin_checkpoint
from .retention import delete_checkpoint, plan_retention

__all__ = [
    "LATEST",
    "MANIFEST",
    "PIN",
    "SENTINEL",
    "Committer",
    "delete",
    "delete_checkpoint",
    "list_step_dirs",
    "mark_incomplete",
    "parse_hf_step",
    "parse_step",
    "pin_checkpoint",
    "plan_retention",
    "rank_file",
    "read_manifest",
    "retain",
    "seal",
    "step_name",
    "unpin_checkpoint",
    "validate_dir",
]
