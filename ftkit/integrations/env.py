"""The former home of the ``FTKIT_*`` reader, kept importable: see :mod:`ftkit.envvars`."""

from __future__ import annotations

from ..envvars import VARIABLES, config_from_env, jobdir_from_env

__all__ = ["VARIABLES", "config_from_env", "jobdir_from_env"]
