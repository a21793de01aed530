"""Integrations with other training frameworks; each one is an optional extra.

    ftkit.integrations.env   FTKIT_* environment variables -> ftkit.Config (no extra needed)
    ftkit.integrations.hf    Hugging Face ``transformers.Trainer`` (``pip install ftkit[hf]``)

Nothing is imported here: ``import ftkit`` and ``import ftkit.integrations`` never pull in
transformers. Import the submodule you use.
"""

__all__: list[str] = []
