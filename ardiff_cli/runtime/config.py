"""Engine configs: YAML (PyYAML's SafeLoader only, no key twice, no number YAML 1.1 reads otherwise than it is
written) -> validated ``EngineConfig``. No torch import.

A config file::

    pipeline: dreamzero      # a registered pipeline name
    checkpoint: null         # .safetensors path, relative to this file; null = the built-in default
    model: {preset: tiny}    # the pipeline's own config (its Config.from_dict validates it)
    runtime:                 # engine settings, all optional
      device: auto           # auto | cpu | cuda | cuda:N
      dtype: float32         # float32 | bfloat16 | float16
      session_capacity: 2    # replaces the pipeline's session_capacity (its spec's bound)
      gpu_memory_fraction: 0.9  # in (0, 1]: share of the available memory for sessions beyond the first
      memory_budget: null    # bytes or "512MiB"; default: free device memory (CPU: available host memory)
      attention_backend: auto
      num_threads: null      # CPU intra-op threads (at most 1024); null = torch's default (OMP_NUM_THREADS)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import re
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path, PurePath
from typing import Any

import yaml

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec, as_scalar
from ardiff_cli.runtime.capacity import (MAX_BYTE_SIZE_TEXT, MAX_SESSIONS, MODEL_DTYPES, as_fraction, as_int,
                                        model_dtype_name, parse_bytes, split_unit_hint)
from ardiff_cli.runtime.errors import (
    PIPELINE_HINT,
    UTF8_LOCALE_HINT,
    ArdiffError,
    ConfigError,
    PipelineError,
    as_typed,
    close_match,
    did_you_mean,
    expand_home,
    field_error,
    link_to_nothing,
    link_to_nothing_on,
    meant_key,
    plural,
    quoted,
    shown,
    too_many_open_files,
    unencodable,
    weights_in_folder,
    yaml_key_note,
    yaml_problem,
    yaml_syntax_hint,
)
from ardiff_cli.runtime.kv.backends import ATTENTION_BACKEND_SETTINGS
from ardiff_cli.runtime.observation import ObservationSchema
from ardiff_cli.runtime.registry import (
    BUILTIN_PIPELINES,
    PipelineEntry,
    called_without_instance,
    registered_pipelines,
    resolve_entry_module,
    resolve_pipeline,
    resolve_pipeline_reference,
)

DEFAULT_CONFIG = "dreamzero-tiny"
TOP_LEVEL_KEYS = ("pipeline", "checkpoint", "model", "runtime")
DEVICES = ("auto", "cpu", "cuda")
MAX_THREADS = 1024  # runtime.num_threads: more than the largest hosts have hardware threads


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"
    dtype: str = "float32"
    session_capacity: int | None = None
    gpu_memory_fraction: float = 0.9
    memory_budget: int | None = None
    attention_backend: str = "auto"
    num_threads: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str) -> RuntimeConfig:
        if not isinstance(data, dict):
            raise field_error(where, "runtime", "a mapping", data)
        for key in data:
            if key not in cls.__dataclass_fields__:
                raise ConfigError(
                    f"{where}: unknown key 'runtime.{key}'{yaml_key_note(key)}"
                    f"{_meant_setting(str(key), data[key], where)}",
                    hint=f"valid runtime keys: {', '.join(cls.__dataclass_fields__)}",
                )
        return cls().with_overrides(where=where, **data)

    def with_overrides(self, *, where: str = "command line", **values: Any) -> RuntimeConfig:
        """A copy with ``values`` (``None`` = keep) validated and applied."""
        changes: dict[str, Any] = {}
        for key, value in values.items():
            if value is None:
                continue
            changes[key] = _validate_runtime_value(key, value, where)
        return replace(self, **changes)


MAX_CUDA_INDEX = 127  # torch.device's index is an 8-bit signed integer


def torch_spelling(value: Any) -> Any:
    """``str()`` of a ``torch.device`` ('cuda:1'), which a Python caller's runtime overrides may be
    (``from_config(..., device=torch.device('cuda', 1))``); ``torch.device('cpu', 0)`` is 'cpu'; any other value as
    it is. Without importing torch. (A ``torch.dtype`` ``model_dtype_name`` reads itself.)"""
    if type(value).__module__ != "torch" or type(value).__name__ != "device":
        return value
    return "cpu" if value.type == "cpu" else str(value)  # cpu:0 is the CPU too


def device_name(value: Any) -> str | None:
    """The canonical spelling (auto, cpu, cuda, cuda:N) of a device given in any case, or None when ``value`` is
    not one. ``runtime.device`` and ``--device`` both read devices through this, so they take the same spellings.
    The index is ASCII digits: ``\\d`` would take ``cuda:\\u0661``, which torch.device() refuses. It is written
    without leading zeros (torch.device() refuses ``cuda:01``) and is at most MAX_CUDA_INDEX: torch keeps it in 8
    bits, so ``cuda:256`` was ``cuda:0``."""
    value = torch_spelling(value)
    if not isinstance(value, str):
        return None
    name = value.strip().lower()
    if name in DEVICES:
        return name
    match = re.fullmatch(r"cuda:0*([0-9]{1,3})", name)
    return f"cuda:{int(match.group(1))}" if match and int(match.group(1)) <= MAX_CUDA_INDEX else None


def _validate_runtime_value(key: str, value: Any, where: str) -> Any:
    field = f"runtime.{key}"
    if key == "device":
        name = device_name(value)
        if name is None:
            raise field_error(where, field, f"auto, cpu, cuda or cuda:N (N from 0 to {MAX_CUDA_INDEX})", value)
        return name
    if key == "dtype":
        name = model_dtype_name(value)
        if name is None:
            raise field_error(where, field, " | ".join(MODEL_DTYPES), value)
        return name
    if key == "session_capacity":
        number = as_int(as_scalar(value))  # numpy's integers and a 0-d integer tensor too, never a bool
        if number is None or not 1 <= number <= MAX_SESSIONS:
            raise field_error(where, field, f"a positive integer up to {MAX_SESSIONS}", value)
        return number
    if key == "gpu_memory_fraction":
        fraction = as_fraction(as_scalar(value))  # numpy's numbers and a 0-d tensor too, never a bool
        if fraction is None:
            raise field_error(where, field, "a number in (0, 1]", value)
        return fraction
    if key == "memory_budget":
        try:
            return parse_bytes(as_scalar(value))  # type: ignore[arg-type]
        except ConfigError as exc:  # past 16EiB it is a byte size still, one too large: the message says so
            too_large = MAX_BYTE_SIZE_TEXT in str(exc)
            expected = (f"a byte size of at most {MAX_BYTE_SIZE_TEXT}" if too_large
                        else "a byte size such as 536870912 or '512MiB'")
            # text is read as --memory-budget reads it ('1_000 MiB' is not a plain number): why, and what it takes
            why = f"{exc}; {exc.hint}" if isinstance(value, str) and not too_large and exc.hint else None
            if isinstance(value, str) and value.lower() == "auto":  # as `device: auto`: it said "no number before"
                why = ("auto is no byte size: leave memory_budget out, or null, for its default (free device memory, "
                       "host memory on CPU), or write a byte size such as 512MiB")
            error = field_error(where, field, expected, value, hint=why)
            raise ConfigTextError(str(error), hint=error.hint) from None
    if key == "num_threads":
        # torch starts that many OpenMP threads: 100000 exhausts the host, 10**30 does not fit its int.
        number = as_int(as_scalar(value))
        if number is None or not 1 <= number <= MAX_THREADS:
            raise field_error(where, field, f"a positive integer up to {MAX_THREADS} (CPU threads) or null", value)
        return number
    if key == "attention_backend":
        # Any case, as --attention-backend takes it (and runtime.device, runtime.dtype): `TORCH` was refused here.
        name = value.strip().lower() if isinstance(value, str) else None
        if name not in ATTENTION_BACKEND_SETTINGS:
            raise field_error(where, field, " | ".join(ATTENTION_BACKEND_SETTINGS), value)
        return name
    raise ConfigError(f"{where}: unknown key {field!r}{_meant_setting(key, value, where)}",
                      hint=f"valid runtime keys: {', '.join(RuntimeConfig.__dataclass_fields__)}")


@dataclass(frozen=True)
class EngineConfig:
    """A validated config: which pipeline, its model config, its checkpoint and the runtime settings."""

    source: str  # file path, built-in name or "<dict>", for messages
    pipeline_name: str
    entry: PipelineEntry  # the registered pipeline (torch-free until pipeline_class() is called)
    model: Any  # the pipeline's Config instance
    checkpoint: Path | None  # None = the pipeline's built-in default checkpoint
    runtime: RuntimeConfig
    sha256: str | None = None  # of the config file's bytes, the very ones parsed (None: a dict)
    # Why ``checkpoint`` is not here (loaded with ``plan_only``: inspect-capacity plans without it); loading refuses it
    checkpoint_missing: str | None = None

    def kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        """The pipeline's KV spec for this config, without torch or weights."""
        return self.model.kv_cache_spec()

    def observation_schema(self) -> Any:
        """The schema of this exact config (a model config may narrow its pipeline's), torch-free."""
        exact = getattr(self.model, "observation_schema", None)
        if callable(exact):
            label, call = f"{type(self.model).__qualname__}.observation_schema", exact
        else:
            module = self.entry.module
            owner = module.__qualname__ if self.entry.is_class else module.__name__
            label, call = f"{owner}.observation_schema", self.entry.observation_schema
        try:
            schema = _pipeline_config_call(self.entry, self.source, label, call)
        except PipelineError as exc:
            if call is exact or not self.entry.is_class:
                raise
            exc.hint = called_without_instance(self.entry.module, "observation_schema", exc.__cause__) or exc.hint
            raise
        if not isinstance(schema, ObservationSchema):  # else every step file would be blamed for it
            raise PipelineError(f"{self.source}: pipeline {self.entry.name!r}: {label}() returned "
                                f"{type(schema).__name__}, expected an ObservationSchema", hint=PIPELINE_HINT)
        problems = schema.problems()
        if problems:
            raise PipelineError(f"{self.source}: pipeline {self.entry.name!r}: the schema {label}() returned: "
                                + "; ".join(problems), hint=PIPELINE_HINT)
        return schema

    def with_runtime(self, *, where: str = "command line", **overrides: Any) -> EngineConfig:
        """A copy with runtime ``overrides`` (``None`` = keep); errors name them as coming from ``where``."""
        return replace(self, runtime=self.runtime.with_overrides(where=where, **overrides))


def path_kind(path: Path, what: str, *, where: str = "") -> str:
    """"file", "folder", "other" (a FIFO, socket or device) or "missing" (a dangling link too) for ``path``; a
    ``ConfigError`` naming ``what`` and the system's reason when it cannot be looked at: a folder on its path that
    this user cannot enter (``Path.is_file()`` raised PermissionError there: "a bug in ardiff"), a link loop."""
    import stat

    why = unencodable(path)
    if why:
        raise ConfigError(f"{where + ': ' if where else ''}cannot look at "
                          f"{what + ' ' if what else ''}{as_typed(path)}: {why}",
                          hint=UTF8_LOCALE_HINT)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except ValueError:  # a NUL (YAML's "\0" escape): os.stat raised ValueError, "a bug in ardiff"
        raise ConfigError(f"{where + ': ' if where else ''}cannot look at "
                          f"{what + ' ' if what else ''}{as_typed(path)}: it holds "
                          "a NUL character, which no file name can", hint="check the path") from None
    except OSError as exc:
        import errno

        hint = ("check the permissions of the folders on its path (each needs x for this user)"
                if exc.errno in (errno.EACCES, errno.EPERM) else "check the links on its path"
                if exc.errno == errno.ELOOP else "check the path")
        raise ConfigError(f"{where + ': ' if where else ''}cannot look at "
                          f"{what + ' ' if what else ''}{as_typed(path)}: {exc.strerror or exc}", hint=hint) from exc
    return "file" if stat.S_ISREG(mode) else "folder" if stat.S_ISDIR(mode) else "other"


def builtin_configs() -> dict[str, Path]:
    """Built-in config names (file stems) -> paths."""
    root = importlib.resources.files("ardiff_cli.configs")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith((".yaml", ".yml"))}


def builtin_schemas() -> dict[str, ObservationSchema]:
    """Built-in config names -> the observation schema of each, read from the configs alone: no torch, no model (a
    tenth of a second for all of them). One that does not load is left out."""
    schemas = {}
    for name in sorted(builtin_configs()):
        try:
            schemas[name] = load_config(name, plan_only=True).observation_schema()
        except ArdiffError:
            continue
    return schemas


def resolve_config(name_or_path: str | Path | None) -> Path:
    """A config file path from a path or a built-in name (default: ``DEFAULT_CONFIG``)."""
    if name_or_path is None:
        name_or_path = DEFAULT_CONFIG
    path = Path(name_or_path)
    kind = path_kind(path, "config")
    if kind == "file":
        return path
    if kind == "other":  # a FIFO would block the read, a device never ends
        raise ConfigError(f"config {as_typed(path)} is not a regular file (a FIFO, socket or device)",
                          hint="pass a YAML file, or a built-in config name")
    builtins = builtin_configs()
    if str(name_or_path) in builtins:
        return builtins[str(name_or_path)]
    dangling = link_to_nothing(path)  # "not found", and "did you mean" its own name, for a disk not mounted
    if dangling:
        raise ConfigError(f"config {as_typed(path)} is {dangling}",
                          hint="mount or restore what it links to, or pass the config's own path")
    if path.suffix.lower() in (".yaml", ".yml") or path.parent != Path("."):
        raise ConfigError(f"config file not found: {as_typed(path)}", hint=_not_found_hint(path, builtins))
    name = str(name_or_path)
    hint = f"built-in configs: {', '.join(sorted(builtins))}"
    unit = split_unit_hint(name)  # `--memory-budget 2 GB`: the shell split the size in two
    hint = f"{unit}; {hint}" if unit else hint
    raise ConfigError(
        f"unknown config {quoted(name)}{did_you_mean(name, builtins)}: not a file and not a built-in config", hint=hint
    )


def _not_found_hint(path: Path, builtins: dict[str, Path]) -> str:
    """Where a relative path was looked for, and what was likely meant: the built-in of that name
    (``dreamzero-tiny.yaml``, ``configs/dreamzero-tiny.yaml``) or a YAML file of a close name next to it."""
    where = "" if path.is_absolute() else f"it is read relative to {Path.cwd()}; "
    builtin = next((name for name in (path.name, path.stem) if name in builtins), None)
    if builtin:
        return f"{where}the built-in config is named without a folder or suffix: {builtin}"
    try:
        near = did_you_mean(path.name, [p.name for p in path.parent.iterdir()
                                        if p.suffix.lower() in (".yaml", ".yml") and p.name != path.name])
    except OSError:  # the folder is missing too, or cannot be listed: nothing to suggest from it
        near = ""
    return f"{where}check the path{near}, or use a built-in config: {', '.join(sorted(builtins))}"


def _nodes(root: yaml.Node) -> Iterator[tuple[yaml.Node, str, bool]]:
    """Every node of the graph under ``root``, in file order, as (node, its dotted path (``model.window_frames``,
    ``a[0]``), whether it is a key). An alias (``*name``) is the same node object as its anchor, so each node is
    read once, where its anchor is: a chain of aliases nine deep (a "billion laughs" file) or an alias inside its own
    anchor would otherwise be walked 10**9 times, or forever."""
    stack: list[tuple[yaml.Node, str, bool]] = [(root, "", False)]
    seen: set[int] = set()
    while stack:
        node, path, is_key = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node, path, is_key
        children: list[tuple[yaml.Node, str, bool]] = []
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = (f"{path}.{key.value}" if path else key.value) if isinstance(key, yaml.ScalarNode) else path
                children += [(key, name, True), (value, name, False)]
        elif isinstance(node, yaml.SequenceNode):
            children = [(item, f"{path}[{i}]", False) for i, item in enumerate(node.value)]
        stack.extend(reversed(children))


def duplicate_key(text: str) -> tuple[str, str] | None:
    """The first key given twice in one mapping, as its dotted path (``model.dim``) and where both are: YAML
    keeps the last one silently, so a second ``runtime:`` block would quietly undo the first. Reads the node
    graph only (nothing constructed), each node once (``_nodes``)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    for node, path, _ in () if root is None else _nodes(root):
        if not isinstance(node, yaml.MappingNode):
            continue
        marks: dict[str, yaml.Mark] = {}
        for key, _value in node.value:
            if isinstance(key, yaml.ScalarNode):
                mark, first = key.start_mark, marks.get(key.value)
                if first is not None:
                    where = (f"lines {first.line + 1} and {mark.line + 1}" if first.line != mark.line
                             else f"line {mark.line + 1}, columns {first.column + 1} and {mark.column + 1}")
                    return (f"{path}.{key.value}" if path else key.value), where
                marks[key.value] = mark
    return None


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that keeps each plain number YAML 1.1 reads otherwise than it is written: a leading 0 makes
    an integer octal (``window_frames: 010`` was 8), and colons make one base 60 (``1:30`` was 90), silently.
    ``0x10``, ``0b11`` and ``1_000`` read as written; ``07`` and ``00`` are the same number either way."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.surprises: list[tuple[yaml.ScalarNode, Any]] = []  # (node, what YAML 1.1 made of it), in file order

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        value = super().construct_yaml_int(node)
        digits = node.value.replace("_", "").lstrip("+-")
        if ":" in digits or (digits[:1] == "0" and digits.isdigit() and int(digits, 10) != abs(value)):
            self.surprises.append((node, value))
        return value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> Any:
        value = super().construct_yaml_float(node)
        if ":" in node.value:  # 1:30.5 is 90.5
            self.surprises.append((node, value))
        return value


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)
_ConfigLoader.add_constructor("tag:yaml.org,2002:float", _ConfigLoader.construct_yaml_float)


def _field_path(root: yaml.Node, target: yaml.Node) -> tuple[str, bool]:
    """The dotted path (``model.window_frames``) of ``target`` in the tree under ``root``, and whether it is a key.
    A node an alias repeats is named where its anchor is (``_nodes``), the line the error gives (a merge key
    ``<<: *base`` or ``sink_frames: *w`` named the alias, under the anchor's line)."""
    for node, path, is_key in _nodes(root):
        if node is target:
            return path or "(the whole file)", is_key
    raise AssertionError("a node _ConfigLoader constructed is not in the tree it composed")


class ConfigTextError(ConfigError):
    """A config's text that an older ardiff may have read and this one refuses: a ``runtime.memory_budget`` (read as
    typed since: '1_000MiB', a tab before its unit), a number YAML 1.1 reads otherwise than written
    (``YAMLNumberError``). On the unchanged config of a run, ``rollout --resume`` says that no edit resumes it (it
    refuses an edited config)."""


class YAMLNumberError(ConfigTextError):
    """A config holds a number YAML 1.1 reads otherwise than it is written (``_refuse_yaml11_number``)."""


def _refuse_yaml11_number(path: Path, root: yaml.Node, node: yaml.ScalarNode, value: Any) -> None:
    """A ConfigError for a number YAML 1.1 read otherwise than it is written (``_ConfigLoader.surprises``)."""
    text = node.value
    if ":" in text:
        why, fix = "base 60 (the colons)", f"write {value} if that number is meant"
    else:
        decimal = int(text.replace("_", ""), 10)
        why, fix = "octal (the leading 0)", f"write {decimal} (or {value}, if octal was meant) without the leading 0"
    field, is_key = _field_path(root, node)
    where = f"{'key' if is_key else 'field'} {field!r} (line {node.start_mark.line + 1})"
    raise YAMLNumberError(f"{as_typed(path)}: {where}: {text} is read as {value!r}: YAML 1.1 takes it as {why}",
                          hint=f"{fix}, or \"{text}\" in quotes for text")


MAX_CONFIG_BYTES = 64 << 10  # a config is a few hundred bytes; PyYAML reads about 0.5 MB/s, and reads it twice


def read_config_bytes(path: Path) -> bytes:
    """The bytes of the config file ``path``; one longer than ``MAX_CONFIG_BYTES`` (never read past them), or that
    cannot be read, is a ``ConfigError`` naming it. What ``read_yaml`` parses and run.json's ``config_sha256`` hashes:
    a resumed run's config replaced by a sparse 8 GB file was read whole to hash it, `Error: MemoryError` (exit 3)."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        if too_many_open_files(exc):  # the process's limit, not the file: no invalid input (exit 2)
            raise
        raise ConfigError(f"cannot read config {as_typed(path)}: {exc.strerror or exc}",
                          hint="check that the user running ardiff may read it and enter its folders "
                               "(permissions)") from None
    if len(raw) > MAX_CONFIG_BYTES:  # a data file given as CONFIG: it stalled for seconds to minutes, silently
        raise ConfigError(f"{as_typed(path)}: more than {MAX_CONFIG_BYTES >> 10} KiB, which no config is: is it "
                          "the config?",
                          hint="pass a config YAML (a few lines: pipeline, model, runtime) or a built-in name")
    return raw


def read_yaml(path: Path) -> tuple[dict[str, Any], str]:
    """The config file's mapping and the SHA-256 of the bytes it was parsed from (run.json's ``config_sha256``: a
    second read to hash it would record an edit made meanwhile)."""
    raw = read_config_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{as_typed(path)}: not UTF-8 text (byte {exc.start}: "
                          f"{exc.object[exc.start:exc.start + 1]!r})",
                          hint="save the config as UTF-8 YAML") from None
    loader = None
    try:
        loader = _ConfigLoader(text)  # its reader refuses a control character here
        root = loader.get_single_node()
        data = None if root is None else loader.construct_document(root)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{as_typed(path)}: {yaml_problem(exc, text)}", hint=yaml_syntax_hint(exc)) from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise ConfigError(f"{as_typed(path)}: lists or mappings are nested too deeply to read",
                          hint="a config is a few levels deep; look for runaway brackets") from None
    except ValueError as exc:  # a plain scalar YAML types but Python cannot hold: 2024-13-45, a 5000-digit number
        raise ConfigError(f"{as_typed(path)}: cannot read a value: {str(exc).split(';')[0]}",
                          hint="quote the value if it is text; numbers in a config are a few digits long") from None
    finally:
        if loader is not None:
            loader.dispose()
    if loader.surprises:
        _refuse_yaml11_number(path, root, *loader.surprises[0])
    if data is None:  # "got NoneType" said nothing to whoever saved an empty file (or only comments, or `~`)
        raise ConfigError(f"{as_typed(path)}: the config is empty (no YAML mapping in it)",
                          hint="a config holds at least `pipeline: NAME`; see README, Configs")
    if not isinstance(data, dict):
        raise ConfigError(f"{as_typed(path)}: a config must be a YAML mapping, got {type(data).__name__}",
                          hint="write it as `key: value` lines, starting with `pipeline: NAME`; see README, Configs")
    duplicate = duplicate_key(text)
    if duplicate is not None:
        key, where = duplicate
        raise ConfigError(f"{as_typed(path)}: key {key!r} is given twice ({where}); YAML would keep the "
                          "second silently",
                          hint="merge the two into one")
    return data, hashlib.sha256(raw).hexdigest()


CONFIG_CONTRACT_HINT = ("a pipeline's Config raises ardiff_cli.runtime.errors.ConfigError naming the field, expected "
                        "and got (README, 'Adding a pipeline'); the cause may be a value in the config's model: "
                        "section; --verbose prints the traceback")


def _pipeline_config_call(entry: PipelineEntry, where: str, label: str, call: Any) -> Any:
    """``call()``, the pipeline's ``label`` (``Config.from_dict``, ...): a ConfigError is the config's; anything else
    it raises is the pipeline's mistake, named as such (not a bug in ardiff), with its exception as the cause."""
    try:
        return call()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - third-party code: whatever it raises is reported, not a traceback
        hint = CONFIG_CONTRACT_HINT
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        if (isinstance(exc, TypeError) and label.endswith(".from_dict")
                and frames[-1].f_code.co_filename == __file__):  # the call did not bind: from_dict's signature
            hint = (f"ardiff calls {label}(data, where=...) on the class, data the config's model: mapping and where "
                    "the config's name, to start a ConfigError's message with: define it as `def from_dict(cls, "
                    "data, *, where)` under @classmethod (README, 'Adding a pipeline')")
        raise PipelineError(f"{where}: pipeline {entry.name!r}: {label}() raised {type(exc).__name__}: {exc}",
                            hint=hint) from exc


def _check_attention_span(spec: ARDiffusionKVCacheSpec, model: Any, where: str) -> None:
    """A window one attention call cannot see (more tokens than the pipeline's ``max_model_len``) is this
    config's mistake: say so naming the file and the field now, not after the weights have loaded. The field is the
    one that brings most of the tokens (it was always ``window_frames``, for a huge ``frames_per_block`` or
    ``height`` too), and the hint says how far to lower it, or which fields make the frame smaller: the pipeline's
    ``max_model_len`` it named is no setting of a config. The runner's own check stays
    (``AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH`` may add scratch)."""
    from ardiff_cli.runtime.kv.layout import KVLayout

    try:
        KVLayout.from_spec(spec, scratch_blocks=1)
    except ConfigError as exc:
        tokens = spec.tokens_per_frame
        frames = {"sink_frames": spec.sink_frames, "window_frames": spec.window_frames,
                  "frames_per_block": spec.frames_per_block}
        registers = spec.max_scratch_tokens_per_branch
        detail = (", ".join(f"{name}={count}" for name, count in frames.items())
                  + f", {tokens} tokens per frame, {plural(registers, 'register token')}")
        largest = max(frames, key=frames.get)
        # the most frames of the largest field that fit, the others as they are (the block comes with its registers)
        most = (spec.max_model_len - registers) // tokens - sum(frames.values()) + frames[largest]
        if registers > frames[largest] * tokens:
            field, fix = "", "lower the pipeline's register tokens per branch"
        elif 2 * tokens + registers > spec.max_model_len:
            # not even a one-frame window and a one-frame block (with the registers) fit: no frame count can help
            sizes = ("height", "width", "vae_stride", "patch_size")
            fix = ("lower the frame size (tokens per latent frame): a smaller 'model.height' or 'model.width', or a "
                   "larger 'model.vae_stride' or 'model.patch_size'" if all(hasattr(model, name) for name in sizes)
                   else "lower the frame size (tokens per latent frame)")
            field = ""
        else:
            setting = getattr(model, largest, None) == frames[largest]  # a field of the config's model: section
            named = f"'model.{largest}'" if setting else largest
            field = f"field {named}: " if setting else ""
            fix = f"lower {named}" + (f" to at most {most}" if most >= (largest != "sink_frames") else "")
        raise ConfigError(f"{where}: {field}{exc} ({detail})", hint=fix) from None


def _runtime_setting(key: object) -> str | None:
    """The runtime setting ``key`` names, case ignored (`NUM_THREADS` is 'num_threads'), or None."""
    folded = str(key).casefold()
    return folded if folded in RuntimeConfig.__dataclass_fields__ else None


def _runtime_setting_in_model(model_data: dict[Any, Any], entry: PipelineEntry, where: str) -> None:
    """Refuse a key of the model: section that is a runtime setting, case ignored, and that the pipeline takes in
    neither spelling: `model: {NUM_THREADS: 2}` was offered 'num_heads', a model key that shares letters with it.
    One the pipeline has too (`session_capacity`) is the pipeline's: its own message names it."""
    fields = _settable_fields(entry.config_class)  # a dataclass names its keys: a value out of range is not taken
    for key, value in model_data.items():            # as an unknown key
        setting = _runtime_setting(key)
        if setting is None or any(name in fields if fields is not None else _takes(entry, {name: value}, where)
                                  for name in (key, setting)):
            continue
        raise ConfigError(f"{where}: unknown key 'model.{key}' (did you mean 'runtime.{setting}'? runtime settings "
                          "go under `runtime:`)",
                          hint=f"move it under `runtime:` as {setting}; model: holds the pipeline's settings")


def _model_setting(entry: PipelineEntry | None, key: object, value: Any, where: str) -> str | None:
    """The model key ``key`` names, case ignored (`NUM_HEADS` is 'num_heads'): a settable field of the pipeline's
    dataclass config (whatever the value: `num_heads: 5` is still a model key), or a key that its ``Config.from_dict``
    takes with its value (`preset: tiny`) while it refuses a key no model has (one that drops unknown keys takes any);
    else None."""
    if entry is None:
        return None
    names = tuple(dict.fromkeys((str(key), str(key).casefold())))
    fields = _settable_fields(entry.config_class) or ()
    named = next((name for name in names if name in fields), None)
    if named is not None or _takes(entry, {"~": None}, where):
        return named
    return next((name for name in names if _takes(entry, {name: value}, where)), None)


def _model_setting_in_runtime(runtime_data: Any, entry: PipelineEntry, where: str) -> None:
    """Refuse a key of the runtime: section that is no runtime setting but a model key of the pipeline, case
    ignored: `runtime: {num_heads: 2}` was offered 'num_threads', a runtime key that shares letters with it."""
    if not isinstance(runtime_data, dict):
        return  # RuntimeConfig.from_dict names it
    for key, value in runtime_data.items():
        model_key = None if _runtime_setting(key) is not None else _model_setting(entry, key, value, where)
        if model_key is not None:
            raise ConfigError(f"{where}: unknown key 'runtime.{key}' (did you mean 'model.{model_key}'? the "
                              "pipeline's settings go under `model:`)",
                              hint=f"move it under `model:` as {model_key}; runtime: holds ardiff's settings: "
                                   f"{', '.join(RuntimeConfig.__dataclass_fields__)}")


def _misplaced_key(key: str, data: dict[str, Any], pipeline: str | None, where: str) -> str:
    """' (did you mean ...?)' for an unknown top-level key: a runtime setting, or a key with its value that the
    pipeline's ``Config.from_dict`` takes (`preset: tiny` for `model: {preset: tiny}`), either in any case, is named
    with its section; else the closest top-level key (one that is a word of the key only with a value it takes:
    `model_path: w.safetensors` gets none); else the runtime or model key it was meant as (:func:`meant_key`, as an
    unknown key under `runtime:` or `model:` is offered one), with its section: `layers` 'model.num_layers', where
    `reset: true` is no 'model.preset'."""
    setting = _runtime_setting(key)
    if setting is not None:
        return f" (did you mean 'runtime.{setting}'? runtime settings go under `runtime:`)"
    try:
        if pipeline is not None:
            entry = resolve_pipeline_reference(pipeline)
        else:
            name = data.get("pipeline")
            entry = resolve_pipeline(name, where=where) if isinstance(name, str) and name else None
    except Exception:  # noqa: BLE001 - no suggestion; the pipeline's own error comes once the key is fixed
        entry = None
    model_key = _model_setting(entry, key, data.get(key), where)
    if model_key is not None:
        return f" (did you mean 'model.{model_key}'? the pipeline's settings go under `model:`)"
    near = close_match(key, TOP_LEVEL_KEYS)
    if near is not None and _top_level_meant(key, near, data.get(key)):
        return f" (did you mean {near!r}?)"
    # else one of the runtime settings and the model keys, looked for among both at once (a key as close to one as to
    # the other gets neither): `layers` is 'model.num_layers', as under model:; `page_size` (merely close to
    # 'patch_size') gets nothing, nor `reset: true` 'model.preset' (a typo of a key that takes no such value)
    sections = {**dict.fromkeys(_model_keys(entry, where), "model"),
                **dict.fromkeys(RuntimeConfig.__dataclass_fields__, "runtime")}
    match = meant_key(key, sections, lambda name: _takes(entry, {name: data.get(key)}, where)
                      if sections[name] == "model" else _runtime_takes(name, data.get(key), where))
    if match is None:
        return ""
    return (f" (did you mean '{sections[match]}.{match}'? "
            + ("runtime settings go under `runtime:`)" if sections[match] == "runtime"
               else "the pipeline's settings go under `model:`)"))


def _top_level_meant(key: str, near: str, value: Any) -> bool:
    """Whether the top-level key ``near`` is what ``key`` meant: a typo of it (`modle`, `runtme`), or a key that holds
    it as a word (`checkpoint_path`, `model_path`) with a value of its kind: a mapping for a section, a string for
    `pipeline` and `checkpoint` (`model_path: w.safetensors` is a checkpoint, not `model:`)."""
    if near not in re.split(r"[\W_]+", key.casefold()):
        return True
    return isinstance(value, dict if near in ("model", "runtime") else str)


def _meant_setting(key: str, value: Any, where: str) -> str:
    """' (did you mean 'x'?)' for an unknown key of the runtime: section with ``value``, where :func:`meant_key` finds
    the setting it was meant as (`threads` 'num_threads'; `gpu: 0.5` none: a GPU may be the device), else ''."""
    match = meant_key(key, RuntimeConfig.__dataclass_fields__, lambda name: _runtime_takes(name, value, where))
    return f" (did you mean {match!r}?)" if match is not None else ""


def _runtime_takes(name: str, value: Any, where: str) -> bool:
    """Whether ``RuntimeConfig.from_dict`` takes ``value`` for the runtime setting ``name``."""
    try:
        RuntimeConfig.from_dict({name: value}, where=where)
    except ConfigError:
        return False
    return True


def _model_keys(entry: PipelineEntry | None, where: str) -> tuple[str, ...]:
    """The keys the pipeline's model: section suggests from, as its own unknown key does: `preset` where its
    ``Config.from_dict`` takes one (and not any key), and the settable fields of its dataclass config; else none."""
    fields = None if entry is None else _settable_fields(entry.config_class)
    if fields is None:
        return ()
    preset = _takes(entry, {"preset": None}, where) and not _takes(entry, {"~": None}, where)
    return (*(("preset",) if preset else ()), *fields)


def _settable_fields(config_class: Any) -> tuple[str, ...] | None:
    """The keys a dataclass config takes: its fields set by its constructor, not a ``ClassVar`` (``WEIGHT_FIELDS``,
    which ``__dataclass_fields__`` holds too: a top-level `WEIGHT_FIELDS:` was told 'model.WEIGHT_FIELDS', which the
    model: section refuses) nor an ``init=False`` one; None for a config that is no dataclass."""
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        return None
    return tuple(field.name for field in dataclasses.fields(config_class) if field.init)


def _other_builtin_taking(model_data: dict[Any, Any], entry: PipelineEntry) -> tuple[str, list[str]] | None:
    """The built-in pipeline other than ``entry``'s whose model: section has every key of ``model_data`` that
    ``entry``'s has not, with those keys; else None. Built-ins only: their entry modules are ardiff's own and
    torch-free, where an installed one's import may run anything."""
    fields = _settable_fields(entry.config_class)
    foreign = [str(key) for key in model_data if fields is not None and key != "preset" and key not in fields]
    if not foreign:
        return None
    for name in BUILTIN_PIPELINES:
        if name == entry.name:
            continue
        try:
            other = resolve_entry_module(BUILTIN_PIPELINES[name], name=name, where="config")
        except Exception:  # noqa: BLE001 - no suggestion
            continue
        theirs = _settable_fields(other.config_class) or ()
        if all(key in theirs for key in foreign):
            return name, foreign
    return None


def _takes(entry: PipelineEntry, model_data: dict[Any, Any], where: str) -> bool:
    """Whether the pipeline's ``Config.from_dict`` takes ``model_data`` as a model section."""
    try:
        entry.config_class.from_dict(model_data, where=where)
    except Exception:  # noqa: BLE001 - third-party code: whatever it raises is a no
        return False
    return True


def load_config(source: str | Path | dict[str, Any] | None = None, *, pipeline: str | None = None,
                plan_only: bool = False) -> EngineConfig:
    """Parse and validate a config from a file, a built-in name or a dict.

    ``pipeline`` is the command line's ``--pipeline``: a registered name or
    ``module:Class`` (which imports ``module``). It replaces the config's
    ``pipeline:`` field, which may then be left out. The config itself can
    only name registered pipelines. ``plan_only``: the config is for a plan, which reads no weights, so a
    ``checkpoint:`` not found here (on another machine's disk) is kept, with why in ``checkpoint_missing``; a
    folder or anything else that is no file is refused all the same.
    """
    digest = None
    if isinstance(source, dict):
        data, where, base = source, "<dict>", Path.cwd()
    elif source is not None and not isinstance(source, (str, PurePath)):
        raise ConfigError(f"a config is a YAML path, a built-in config name or a dict, got {shown(source)}",
                          hint=f"built-in configs: {', '.join(sorted(builtin_configs()))}")
    else:
        path = resolve_config(source)
        (data, digest), where, base = read_yaml(path), as_typed(path), path.parent
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(
                f"{where}: unknown key {key!r}{yaml_key_note(key)}{_misplaced_key(str(key), data, pipeline, where)}",
                hint=f"valid top-level keys: {', '.join(TOP_LEVEL_KEYS)}",
            )
    name = data.get("pipeline")
    if pipeline is not None:
        entry = resolve_pipeline_reference(pipeline)
        name = entry.name
    else:
        if not isinstance(name, str) or not name:
            raise field_error(where, "pipeline", "a registered pipeline name", name,
                              hint="add e.g. `pipeline: dreamzero` to the config, or pass --pipeline")
        entry = resolve_pipeline(name, where=where)
    model_data = {} if data.get("model") is None else data["model"]  # `model: []` or `model: 0` is a mistake
    if not isinstance(model_data, dict):
        raise field_error(where, "model", "a mapping", model_data)
    _runtime_setting_in_model(model_data, entry, where)
    config_class = entry.config_class.__qualname__
    try:
        model = _pipeline_config_call(entry, where, f"{config_class}.from_dict",
                                      lambda: entry.config_class.from_dict(model_data, where=where))
    except ConfigError as exc:
        named = data.get("pipeline")
        # Another pipeline's settings: a config naming a registered pipeline other than --pipeline's. One naming an
        # unregistered one is that pipeline class's own config (`pipeline: my_world` before it is packaged).
        if (pipeline is not None and isinstance(named, str) and named != entry.name
                and named in registered_pipelines()):
            exc.hint = (f"the config is for pipeline {data['pipeline']!r}, but --pipeline {pipeline} reads its "
                        "model: section: drop --pipeline, or give a config of that pipeline"
                        + (f"; {exc.hint}" if exc.hint else ""))
        elif (pipeline is None and "unknown key 'model." in str(exc)
              and (other := _other_builtin_taking(model_data, entry)) is not None):
            # a config copied from another pipeline's, `pipeline:` edited (or the other way round): named by a key
            # that pipeline has, which alone said "unknown key", as of a typo
            owner, keys = other
            exc.hint = (f"{', '.join(map(repr, keys))} {'is a key' if len(keys) == 1 else 'are keys'} of pipeline "
                        f"{owner!r}, and this config names pipeline {entry.name!r}: set `pipeline: {owner}` if it is "
                        f"that model's config, else remove {'it' if len(keys) == 1 else 'them'}"
                        + (f"; {exc.hint}" if exc.hint else ""))
        raise
    if not isinstance(model, entry.config_class):  # else "kv_cache_spec() raised AttributeError" on a dict, say
        raise PipelineError(f"{where}: pipeline {entry.name!r}: {config_class}.from_dict() returned "
                            f"{type(model).__name__}, expected a {config_class}", hint=CONFIG_CONTRACT_HINT)
    spec = _pipeline_config_call(entry, where, f"{config_class}.kv_cache_spec", lambda: model.kv_cache_spec())
    if not isinstance(spec, ARDiffusionKVCacheSpec):
        raise PipelineError(f"{where}: pipeline {entry.name!r}: {config_class}.kv_cache_spec() returned "
                            f"{type(spec).__name__}, expected an ARDiffusionKVCacheSpec", hint=CONFIG_CONTRACT_HINT)
    _check_attention_span(spec, model, where)
    checkpoint, missing = data.get("checkpoint"), None
    if checkpoint is not None:
        if not isinstance(checkpoint, str) or not checkpoint:
            raise field_error(where, "checkpoint", "a .safetensors path or null", checkpoint)
        checkpoint = Path(expand_home(checkpoint, f"{where}: field 'checkpoint': {checkpoint}",
                                      hint="set HOME to this user's home folder, or write the checkpoint's full path"))
        written, relative = checkpoint, not checkpoint.is_absolute()
        if relative:
            checkpoint = base / checkpoint
        kind = path_kind(checkpoint, "", where=f"{where}: field 'checkpoint'")
        # the file, or a folder above it, a link that leads nowhere (a disk not mounted): named, not "not found"
        dangling = link_to_nothing_on(checkpoint) if kind == "missing" else None
        said = None if dangling is None else (f"{as_typed(checkpoint)} is {dangling[1]}" if dangling[0] == checkpoint
                                              else f"{as_typed(checkpoint)} cannot be reached: {as_typed(dangling[0])} "
                                              f"is {dangling[1]}")
        if kind == "missing" and plan_only:
            missing = said or f"file not found: {as_typed(checkpoint)}"
        elif said:
            raise ConfigError(f"{where}: field 'checkpoint': {said}",
                              hint="mount or restore what it links to, or give the .safetensors file's own path")
        elif kind != "file":
            found = {"folder": "a folder, not a file", "other": "not a regular file"}.get(kind, "file not found")
            # A path written relative to the folder the user runs from (or a config linked from elsewhere) was only
            # named as not found: say where a relative one is read from.
            origin = "the current folder" if isinstance(source, dict) else f"the config file's folder, {base.resolve()}"
            inside = weights_in_folder(checkpoint, written) if kind == "folder" else ""
            raise ConfigError(
                f"{where}: field 'checkpoint': {found}: {as_typed(checkpoint)}",
                hint=(f"a relative checkpoint path is read from {origin}; " if relative and kind == "missing" else "")
                + (f"{inside}, or set" if inside else "give the .safetensors file's path, or set")
                + " checkpoint: null to use the pipeline's built-in default",
            )
    _model_setting_in_runtime(data.get("runtime"), entry, where)
    runtime = RuntimeConfig.from_dict({} if data.get("runtime") is None else data["runtime"], where=where)
    return EngineConfig(
        source=where, pipeline_name=name, entry=entry, model=model, checkpoint=checkpoint, runtime=runtime,
        sha256=digest, checkpoint_missing=missing,
    )
