"""The between-steps check and cross-rank agreement."""

from .agreement import AgreementConfig
from .controller import Config, FaultTolerance

__all__ = ["AgreementConfig", "Config", "FaultTolerance"]
