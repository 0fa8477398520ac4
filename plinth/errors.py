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


class RequestFailedError(UserFacingError, RuntimeError):
    """The engine ended a request with an error of that request's own (a custom logits processor that failed on
    it) while other requests went on. Offline calls raise it after every request of the call is done, with all
    their outputs in ``outputs``."""

    def __init__(self, message: str, outputs: list | None = None):
        super().__init__(message)
        self.outputs = outputs or []


class SleepModeError(UserFacingError, RuntimeError):
    """Sleep mode used where it cannot be: off (``enable_sleep_mode``), requests still running, a bad level or tag;
    or a request or weight update sent to a sleeping engine. The message says what to do."""


class EngineSleepingError(SleepModeError):
    """A request, or a weight update, sent to an engine (or weights) asleep: wake it up first."""
