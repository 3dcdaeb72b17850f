"""The one error type of a config that cannot describe a runnable model."""


class ConfigError(ValueError):
    """A config value that cannot describe a runnable model."""
