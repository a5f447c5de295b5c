import os
from configparser import ConfigParser
from dataclasses import dataclass, field
from pathlib import Path

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    pass


def parse_bool(text):
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def parse_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


@dataclass
class DatabaseSettings:
    host: str = "localhost"
    port: int = 5432
    name: str = "app"
    user: str = "app"
    password: str = ""
    pool_size: int = 5


@dataclass
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8080
    debug: bool = False
    allowed_origins: list = field(default_factory=list)


@dataclass
class Settings:
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    server: ServerSettings = field(default_factory=ServerSettings)


def _apply(section, values, prefix, environ):
    for name, current in vars(section).items():
        env_name = f"{prefix}_{name}".upper()
        raw = environ.get(env_name, values.get(name))
        if raw is None:
            continue
        if isinstance(current, bool):
            value = parse_bool(raw)
        elif isinstance(current, int):
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{env_name} must be an integer, got {raw!r}") from None
        elif isinstance(current, list):
            value = parse_list(raw)
        else:
            value = raw
        setattr(section, name, value)


def load_settings(path=None, environ=None):
    environ = os.environ if environ is None else environ
    parser = ConfigParser()
    if path is not None:
        if not Path(path).exists():
            raise ConfigError(f"config file not found: {path}")
        parser.read(path)
    settings = Settings()
    for name in ("database", "server"):
        values = dict(parser[name]) if parser.has_section(name) else {}
        _apply(getattr(settings, name), values, f"app_{name}", environ)
    if settings.server.port < 1 or settings.server.port > 65535:
        raise ConfigError(f"server port out of range: {settings.server.port}")
    return settings
