"""User-facing errors: one line each, naming the field or file and the limit or expected value.

The CLI prints ``str(error)`` and exits with the class's ``exit_code`` (documented in docs/cli.md);
no traceback is shown for these. Anything else is a bug and keeps its traceback.
"""


class ColibriError(Exception):
    """An expected failure the operator can act on."""

    exit_code = 1


class ConfigError(ColibriError):
    """A configuration value (flag, env, file, config.json key) is missing or out of range."""

    exit_code = 2


class ModelFormatError(ColibriError):
    """A model directory or checkpoint is malformed: bad manifest, path, size, dtype or shape."""

    exit_code = 3


class ChecksumError(ModelFormatError):
    """A tensor's bytes do not match the crc32 recorded in the manifest."""

    exit_code = 4


class InvalidRequestError(ColibriError):
    """A request field is out of range (maps to INVALID_ARGUMENT)."""

    exit_code = 2

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field

    @property
    def detail(self) -> str:
        """The message without its `field: ` prefix."""
        return str(self)[len(self.field) + 2 :]


class NonFiniteLogitsError(ColibriError):
    """The model produced NaN/inf logits for a sequence (NON_FINITE_LOGITS)."""

    exit_code = 5


class CapacityError(ColibriError):
    """Not enough KV-cache blocks for what was asked (maps to RESOURCE_EXHAUSTED)."""

    exit_code = 6


class AddressInUseError(ColibriError):
    """A port or socket a server must listen on is taken or cannot be bound; the message names the role
    and the address. A restart does not help, so `colibri serve` does not restart on it."""

    exit_code = 7
