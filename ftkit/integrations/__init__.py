"""Integrations with other training frameworks; each one is an optional extra.

    ftkit.integrations.hf    Hugging Face ``transformers.Trainer`` (``pip install ftkit[hf]``)

Nothing is imported here: ``import ftkit`` and ``import ftkit.integrations`` never pull in
transformers. Import the submodule you use. The ``FTKIT_*`` variables every integration
reads are configuration, not an integration: :mod:`ftkit.envvars`.
"""

__all__: list[str] = []
