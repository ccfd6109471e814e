"""Where paged-chat keeps its files, and the settings in config.toml.

Paths: platformdirs locations, each overridable by an env var, so tests and scripted runs
keep everything out of the real home directory. Each directory is created on first use,
so callers can write into it straight away. The data and cache directories are private
(0700, as ssh and gpg keep theirs): chats are personal. One that other users can read is
made private when it is next used, with a one-time warning saying so.

Settings: config.toml holds the user's defaults in three tables, `[engine]` (EngineConfig
knobs), `[chat]` (system prompt and sampling defaults) and `[tui]` (theme, and
`[tui.keys]`: action -> key). A missing file means defaults; an unknown key or a bad value
is a SettingsError naming the file, the line and the key, so a typo never silently falls
back to a default. Command-line options override the file through the `**overrides` of
`Settings.engine_config` and `Settings.sampling_params`.

The `[engine]` and `[chat]` keys are not written out here: `[engine]` is every
EngineConfig field, `[chat]` the system prompt and the SamplingParams fields a chat keeps
(CHAT_SAMPLING_KEYS), each with the dataclass's own type. So a new engine knob is a
setting the moment it exists, and the ranges live in one place (the engine's validators,
which run when settings are loaded).

This module imports neither torch nor the engine's model code at import time (the CLI's
`--help` must start fast): the two config dataclasses come from light modules.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import stat
import tomllib
import typing
import urllib.parse
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from paged_chat.engine.core.config import EngineConfig
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.regular_files import NotARegularFileError, read_regular

APP_NAME = "paged-chat"
# A config file is a few hundred bytes; anything near this is not one (or is /dev/zero).
MAX_CONFIG_BYTES = 1 << 20


def _ensure(path: Path, variable: str, mode: int = 0o777) -> Path:
    """`path`, a directory, created (with `mode`, less the umask) if it is missing;
    `variable` is the environment variable that can move it."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} should be a directory but is a file: move the file "
                                 f"away, or set {variable} to use another place")
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    return path


def _ensure_private(path: Path, variable: str) -> Path:
    """`path`, a directory only its owner can use, created or tightened (see the module
    docstring)."""
    notice = make_private(_ensure(path, variable, 0o700), 0o700)
    if notice:
        warnings.warn(notice, stacklevel=3)
    return path


def make_private(path: Path, mode: int) -> str | None:
    """Take the group and other permissions off `path`, keeping at most `mode`; a notice
    saying what changed (or that it could not), None when it was private already."""
    old = stat.S_IMODE(path.stat().st_mode)
    if not old & 0o077:
        return None
    try:
        os.chmod(path, old & mode)
    except OSError as exc:  # a read-only file system, or someone else's file
        return f"{path} can be read by other users (mode {old:04o}) and could not be made private: {exc.strerror}"
    return f"{path} could be read by other users (mode {old:04o}): made it private (mode {old & mode:04o})"


def _env_path(var: str) -> Path | None:
    value = os.environ.get(var)
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """Converted artefacts that can be rebuilt at any time (e.g. GGUF tokenizers)."""
    return _ensure_private(_env_path("PAGED_CHAT_CACHE_DIR") or platformdirs.user_cache_path(APP_NAME),
                           "PAGED_CHAT_CACHE_DIR")


def data_dir() -> Path:
    """User data that cannot be rebuilt (the chat store)."""
    return _ensure_private(_env_path("PAGED_CHAT_DATA_DIR") or platformdirs.user_data_path(APP_NAME),
                           "PAGED_CHAT_DATA_DIR")


def config_path() -> Path:
    """The config.toml file; it may not exist yet."""
    return _env_path("PAGED_CHAT_CONFIG") or platformdirs.user_config_path(APP_NAME) / "config.toml"


def config_dir() -> Path:
    """The directory holding config.toml."""
    return _ensure(config_path().parent, "PAGED_CHAT_CONFIG")


class SettingsError(ValueError):
    """config.toml is unreadable, not TOML, or holds an unknown key or a bad value.

    A ValueError like EngineConfig's own errors; the message names the file, the line (when
    it can be found) and the key.
    """


# The SamplingParams fields a chat keeps (in the store and in `[chat]`) and its settings
# dialog edits; the others (stop strings, penalties beyond repetition) are per request.
CHAT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                      "max_tokens", "seed")
# What SmolLM2 (the default model) recommends: low temperature, top-p 0.9.
_CHAT_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512}
# Where the engine may write is the app's cache dir, not a user setting.
_NOT_SETTINGS = {"cache_dir"}


def _optional(hint: Any) -> Any:
    return hint if type(None) in typing.get_args(hint) else hint | None


def _chat_sampling_fields() -> list[tuple[str, Any, Any]]:
    hints = typing.get_type_hints(SamplingParams)
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    return [(name, hints[name], field(default=_CHAT_SAMPLING_DEFAULTS.get(name, defaults[name])))
            for name in CHAT_SAMPLING_KEYS]


def _sampling(self: Any) -> dict[str, Any]:
    """The sampling defaults as SamplingParams keyword arguments (what a chat stores)."""
    return {name: getattr(self, name) for name in CHAT_SAMPLING_KEYS}


_ENGINE_HINTS = typing.get_type_hints(EngineConfig)
EngineSettings = dataclasses.make_dataclass(
    "EngineSettings",
    [(f.name, _optional(_ENGINE_HINTS[f.name]), field(default=None))
     for f in dataclasses.fields(EngineConfig) if f.name not in _NOT_SETTINGS],
    slots=True)
EngineSettings.__doc__ = """`[engine]`: the EngineConfig fields a user may set. None (not in
the file) means EngineConfig's own default, so the engine stays the one place defaults live."""

ChatSettings = dataclasses.make_dataclass(
    "ChatSettings", [("system_prompt", str | None, field(default=None)), *_chat_sampling_fields()],
    slots=True, namespace={"sampling": _sampling})
ChatSettings.__doc__ = """`[chat]`: what a new chat starts with: its system prompt and the
CHAT_SAMPLING_KEYS of SamplingParams, defaulting to what the default model recommends."""


def chat_sampling(params: SamplingParams) -> dict[str, Any]:
    """What a chat stores of the sampling it was started with."""
    return {name: getattr(params, name) for name in CHAT_SAMPLING_KEYS}


@dataclass(slots=True)
class TuiSettings:
    """`[tui]`: the Textual theme name, where the engine runs (`engine_process`: in a
    process of its own, the default, or on a thread of the app, which shares the app's GIL
    and loses a fifth or more of its speed while tabs stream), and `[tui.keys]` (action
    name -> key, e.g. `new_chat = "ctrl+n"`); the TUI validates action names against its
    own bindings."""

    theme: str = "textual-dark"
    engine_process: bool = True
    keys: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class TuiVocabulary:
    """What the TUI knows, to check `[tui]` against before it starts (settings never imports
    the TUI: its front end passes this in): its action names, its themes, and the key names
    a binding may use besides a single character (e.g. "f1", "pagedown", "question_mark")."""

    actions: frozenset[str]
    themes: frozenset[str]
    key_names: frozenset[str]


# The modifiers a `[tui.keys]` key may have, as in "ctrl+shift+up".
KEY_MODIFIERS = ("ctrl", "shift", "alt", "meta", "super", "hyper")


@dataclass(slots=True)
class ServerSettings:
    """`[server]`: an OpenAI-compatible server to use instead of the in-process engine
    (`url`, e.g. "http://127.0.0.1:8000/v1"), and its API key; `--server` / `--api-key`
    override them. For the server paged-chat runs (`serve`, `--serve`): `allowed_origins`,
    the web origins (e.g. "https://chat.example:8443") a keyless server takes besides
    loopback ones, and `share_cache_with_tui`, whether API requests may hit the prefix
    cache of the TUI's tabs under `--serve` (off: a caller could probe a chat's text)."""

    url: str | None = None
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    share_cache_with_tui: bool = False


@dataclass(slots=True)
class Settings:
    """The effective settings: config.toml over the defaults. `path` is the file they came
    from, None when there was none (all defaults)."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    chat: ChatSettings = field(default_factory=ChatSettings)
    tui: TuiSettings = field(default_factory=TuiSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    path: Path | None = None
    # The `[chat]` keys the file sets: those win over a model's generation config.
    chat_keys_set: frozenset[str] = frozenset()

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """An EngineConfig from `[engine]`, with `overrides` on top (None values are ignored,
        so a CLI can pass every option it has, given or not). A model in another app's store
        (`ollama:...`, `lmstudio:...`) becomes its GGUF file's path here."""
        from paged_chat.app.model_stores import resolve_model_spec

        config = {"cache_dir": str(cache_dir()), **_given(dataclasses.asdict(self.engine)),
                  **_given(overrides)}
        if isinstance(config.get("model"), str):
            config["model"] = resolve_model_spec(config["model"])
        return EngineConfig(**config)

    def sampling_params(self, generation_defaults: dict[str, Any] | None = None, /,
                        **overrides: Any) -> SamplingParams:
        """SamplingParams from the model's defaults (`model_sampling`), with `overrides` on
        top (any SamplingParams field; None values are ignored)."""
        return SamplingParams(**{**self.model_sampling(generation_defaults or {}),
                                 **_given(overrides)})

    def model_sampling(self, generation_defaults: dict[str, Any]) -> dict[str, Any]:
        """The sampling a model's turns get where nothing else is asked: what config.toml's
        `[chat]` sets, then the model's generation config (ModelInfo.generation_defaults),
        then `[chat]`'s defaults. `ask`, `chat` and `serve` all start from these."""
        return self.chat.sampling() | {name: value for name, value in generation_defaults.items()
                                       if name not in self.chat_keys_set}

    def request_defaults(self, generation_defaults: dict[str, Any]) -> dict[str, Any]:
        """What `serve` gives an API request for the sampling fields it omits: the model's
        sampling (`model_sampling`), but max_tokens and seed, which stay the request's own."""
        return {name: value for name, value in self.model_sampling(generation_defaults).items()
                if name not in ("max_tokens", "seed") and value is not None}

    def to_toml(self) -> str:
        """These settings as config.toml text, engine defaults filled in; values that stay
        unset (the engine sizes or picks them) appear commented out."""
        config = self.engine_config()
        engine = [(name, getattr(config, name) if value is None else value)
                  for name, value in _scalar_items(self.engine)]
        lines: list[str] = []
        for table, items in (("engine", engine), ("chat", _scalar_items(self.chat)),
                             ("tui", _scalar_items(self.tui))):
            lines.append(f"[{table}]")
            for name, value in items:
                lines.append(f"# {name} = (not set)" if value is None else f"{name} = {_toml_value(value)}")
            lines.append("")
        lines.append("[tui.keys]")
        lines.extend(f"{_toml_key(action)} = {_toml_value(key)}"
                     for action, key in sorted(self.tui.keys.items()))
        return "\n".join(lines) + "\n"


def load_settings(path: Path | None = None,
                  tui: Callable[[], TuiVocabulary] | None = None) -> Settings:
    """Read config.toml (`path`, or `config_path()`); a missing file means defaults.

    Raises SettingsError for an unreadable file (what is not a regular file, or more than
    MAX_CONFIG_BYTES, is refused unread), a TOML syntax error (its message has the line and
    column), an unknown table or key, or a value of the wrong type or range. With `tui`,
    `[tui]`'s theme and `[tui.keys]` are checked against what the TUI knows too: `tui()`
    says what that is, called only where the file sets either (it imports Textual, which a
    start that launches the engine first does not wait for).
    """
    path = path or config_path()
    try:
        text = read_regular(path, MAX_CONFIG_BYTES).decode("utf-8-sig")  # a BOM (Notepad's) is fine
    except FileNotFoundError:
        return Settings()
    except NotARegularFileError as exc:
        raise SettingsError(f"cannot read the config file: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{path}: cannot read the config file ({exc})") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: invalid TOML: {exc}") from exc
    except RecursionError:
        raise SettingsError(f"{path}: invalid TOML: its arrays or tables nest too deeply") from None
    return _Loader(path, text, tui).settings(data)


_SECTIONS = {"engine": EngineSettings, "chat": ChatSettings, "tui": TuiSettings,
             "server": ServerSettings}


class _Loader:
    """Checks parsed TOML against the settings dataclasses, locating errors in the text."""

    def __init__(self, path: Path, text: str,
                 tui: Callable[[], TuiVocabulary] | None = None) -> None:
        self.path = path
        self.lines = text.splitlines()
        self._vocabulary = tui

    @functools.cached_property
    def tui(self) -> TuiVocabulary | None:
        return self._vocabulary() if self._vocabulary is not None else None

    def settings(self, data: dict[str, Any]) -> Settings:
        self._known(data, _SECTIONS, table=None)
        sections = {name: self._section(name, cls, data.get(name, {}))
                    for name, cls in _SECTIONS.items()}
        settings = Settings(**sections, path=self.path,
                            chat_keys_set=frozenset(data.get("chat", {})))
        self._check_with_engine(settings)
        self._check_server_url(settings.server.url)
        if "theme" in data.get("tui", {}):
            self._check_theme(settings.tui.theme)
        return settings

    def _section(self, table: str, cls: type, data: Any) -> Any:
        if not isinstance(data, dict):
            raise self._error(table, None, f"{table} must be a table: write [{table}]")
        hints = typing.get_type_hints(cls)
        self._known(data, hints, table)
        values = {}
        for key, value in data.items():
            if table == "tui" and key == "keys":
                values[key] = self._keys(value)
            elif table == "server" and key == "allowed_origins":
                values[key] = self._origins(value)
            else:
                values[key] = self._typed(table, key, value, hints[key])
        return cls(**values)

    def _keys(self, data: Any) -> dict[str, str]:
        if not isinstance(data, dict):
            raise self._error("tui", "keys", "tui.keys must be a table: write [tui.keys]")
        for action, key in data.items():
            if self.tui is not None and action not in self.tui.actions:
                near = difflib.get_close_matches(action, list(self.tui.actions), n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise self._error("tui.keys", action, f"unknown action {_dotted('tui.keys', action)!r}: "
                                                      f"{hint}actions: {', '.join(sorted(self.tui.actions))}")
            problem = self._key_problem(key)
            if problem:
                raise self._error("tui.keys", action, f"tui.keys.{action} = {_toml_value(key)} is "
                                                      f"invalid: {problem}")
        return dict(data)

    def _origins(self, data: Any) -> list[str]:
        from paged_chat.server.guards import OriginError, normalize_origin

        if not isinstance(data, list) or not all(isinstance(origin, str) for origin in data):
            raise self._error("server", "allowed_origins", "server.allowed_origins = "
                              f"{_toml_value(data)} is invalid: expected a list of origins like "
                              '["https://chat.example"]')
        try:
            return [normalize_origin(origin) for origin in data]
        except OriginError as exc:
            raise self._error("server", "allowed_origins", f"server.allowed_origins: {exc}") from exc

    def _key_problem(self, keys: Any) -> str | None:
        """What is wrong with a `[tui.keys]` value ("ctrl+n", or several: "f2,ctrl+e"), None
        when nothing is. Modifiers are always checked, key names only against the TUI's."""
        expected = 'expected a key like "ctrl+n" (several: "f2,ctrl+e")'
        if not isinstance(keys, str) or not keys.strip():
            return expected
        for key in keys.split(","):
            *modifiers, name = key.strip().split("+")
            unknown = [modifier for modifier in modifiers if modifier not in KEY_MODIFIERS]
            if unknown:
                return (f"{unknown[0]!r} is not a modifier (modifiers: {', '.join(KEY_MODIFIERS)}); "
                        f"{expected}")
            if len(set(modifiers)) < len(modifiers):
                return f"{key.strip()!r} repeats a modifier; {expected}"
            known_name = len(name) == 1 and name.isprintable() and not name.isspace()
            if not known_name and (not name or self.tui is not None and name not in self.tui.key_names):
                return f"{name!r} is not a key name; {expected}"
        return None

    def _check_theme(self, theme: str) -> None:
        if self.tui is not None and theme not in self.tui.themes:
            raise self._error("tui", "theme", f"tui.theme = {_toml_value(theme)} is invalid: no "
                                              f"such theme; themes: {', '.join(sorted(self.tui.themes))}")

    def _check_server_url(self, url: str | None) -> None:
        """`[server] url` must be an http(s) URL with a host (and a port that is a number)."""
        if url is None:
            return
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 -- parsing the port raises for one that is not a number
            problem = None if parts.scheme in ("http", "https") and parts.hostname else (
                "expected an http:// or https:// URL with a host")
        except ValueError as exc:
            problem = str(exc)
        if problem:
            raise self._error("server", "url", f"server.url = {_toml_value(url)} is invalid: "
                                               f"{problem}, e.g. \"http://127.0.0.1:8000/v1\"")

    def _typed(self, table: str, key: str, value: Any, hint: Any) -> Any:
        """The value if it fits the field's type (an int is a fine float), else an error."""
        allowed = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
        for kind in allowed:
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
                return value
        names = " or ".join(_TYPE_NAMES[t] for t in allowed)
        raise self._error(table, key, f"{_dotted(table, key)} = {_toml_value(value)} is invalid: "
                                      f"expected {names}")

    def _check_with_engine(self, settings: Settings) -> None:
        """Run each value through EngineConfig / SamplingParams, one key at a time, so the
        ranges live in one place (the engine) and the error still names the key."""
        checks = [("engine", EngineConfig, name, value) for name, value in _scalar_items(settings.engine)]
        checks += [("chat", SamplingParams, name, value) for name, value in settings.chat.sampling().items()]
        for table, validator, name, value in checks:
            if value is None:
                continue
            try:
                validator(**{name: value})
            except ValueError as exc:
                reason = str(exc).split(" is invalid: ", 1)[-1]
                raise self._error(table, name, f"{_dotted(table, name)} = {_toml_value(value)} "
                                               f"is invalid: {reason}") from exc

    def _known(self, data: dict[str, Any], known: Any, table: str | None) -> None:
        for key in data:
            if key not in known:
                near = difflib.get_close_matches(key, list(known), n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                what = "section" if table is None else "key"
                raise self._error(table, key, f"unknown {what} {_dotted(table, key)!r}: "
                                              f"{hint}known {what}s: {', '.join(known)}")

    def _error(self, table: str | None, key: str | None, message: str) -> SettingsError:
        line = self._line_of(_dotted(table, key))
        where = f"{self.path}, line {line}" if line else str(self.path)
        return SettingsError(f"{where}: {message}")

    def _line_of(self, target: str) -> int | None:
        """The 1-based line that defines the dotted name `target` (a table header or a key
        assignment, dotted keys and quoting included); None when the text hides it."""
        table = ""
        for number, line in enumerate(self.lines, start=1):
            header = _HEADER.match(line)
            assignment = None if header else _ASSIGNMENT.match(line)
            if header:
                table = name = _key_path(header.group(1))
            elif assignment:
                name = _dotted(table, _key_path(assignment.group(1)))
            else:
                continue
            if name == target or name.startswith(target + "."):
                return number
        return None


_QUOTED = r""""(?:[^"\\]|\\.)*"|'[^']*'"""
_HEADER = re.compile(rf"\s*\[\s*((?:{_QUOTED}|[^\[\]\"'])+?)\s*\]\s*(#.*)?$")
_ASSIGNMENT = re.compile(rf"\s*((?:{_QUOTED}|[A-Za-z0-9_\-. \t])+?)\s*=")
_KEY_PART = re.compile(rf"\s*({_QUOTED}|[A-Za-z0-9_-]+)\s*(?:\.|$)")
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _dotted(*parts: str | None) -> str:
    return ".".join(part for part in parts if part)


def _key_path(text: str) -> str:
    """A TOML key as written (dotted, quoted parts allowed) as its dotted name."""
    parts, position = [], 0
    while position < len(text):
        match = _KEY_PART.match(text, position)
        if match is None or match.end() == position:
            break
        part = match.group(1)
        parts.append(part[1:-1] if part[0] in "\"'" else part)
        position = match.end()
    return ".".join(parts)


def _given(overrides: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in overrides.items() if value is not None}


def _scalar_items(section: Any) -> list[tuple[str, Any]]:
    return [(f.name, getattr(section, f.name)) for f in dataclasses.fields(section)
            if not isinstance(getattr(section, f.name), dict)]


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    """A TOML literal for the values settings hold (strings, numbers, booleans); the repr
    of anything else, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\u{ord(m.group()):04x}", escaped) + '"'
    return repr(value)
