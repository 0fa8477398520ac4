"""Exceptions a user acts on. Each message says what was wrong and what would be accepted."""

from __future__ import annotations


class UserFacingError(Exception):
    """Base of errors caused by user input (bad model path, unsupported option, ...)."""


class CliError(UserFacingError):
    """A bad command-line usage: printed as one line, exit status 2."""


class ModelLoadError(UserFacingError, ValueError):
    """A model could not be loaded; the message names the file and, where known, the tensor."""


class UnsupportedModelError(UserFacingError, ValueError):
    """The model's architecture has no implementation; the message lists the supported ones."""


class SelectionError(UserFacingError, ValueError):
    """A forced platform, backend or kernel cannot run; the message gives its reason."""


class LoRAAdapterError(UserFacingError, ValueError):
    """A LoRA adapter that cannot be served; the message names the folder and what is wrong with it."""
