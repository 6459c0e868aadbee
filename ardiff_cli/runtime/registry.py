"""The pipeline registry: what a config may name, and the one explicit way to load other code. No torch import.

A pipeline is an *entry*: something cheap to import (no torch) that carries

- ``Config``: the model config dataclass (``from_dict(data, where=)``, ``kv_cache_spec()``),
- ``observation_schema()``: the robot observation schema,
- ``pipeline_class()``: the pipeline class (the one place that imports torch and the model code).

Two kinds of entry exist:

- an *entry module* (``pipelines.dreamzero``): the built-ins listed here, and
  the modules other packages register in the ``ardiff.pipelines`` entry-point
  group (``name = "package.module"`` in their ``pyproject.toml``). A config
  names one of these by its registered name, and nothing else;
- a *pipeline class* named on the command line as ``--pipeline module:Class``.
  The class itself carries ``Config`` and ``observation_schema`` (class
  attributes) next to the capability methods. Importing ``module`` runs its
  code, which is why only an explicit command-line option may ask for it:
  a config file (or a ``run.json`` being resumed) never imports arbitrary code.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import traceback
import types
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ardiff_cli.runtime.errors import (
    ArdiffWarning,
    ConfigError,
    PipelineError,
    as_typed,
    close_match,
    did_you_mean,
    is_out_of_memory,
    quoted,
    running_out_of_memory_names,
    shell_word,
)

BUILTIN_PIPELINES = {
    "dreamzero": "pipelines.dreamzero",
    "causal_world": "pipelines.causal_world",
}
ENTRY_POINT_GROUP = "ardiff.pipelines"
ENTRY_ATTRS = ("Config", "observation_schema", "pipeline_class")  # what an entry module carries
CLASS_ATTRS = ("Config", "observation_schema", "from_config", "forward")  # what a --pipeline class carries
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
CLASS_REFERENCE = re.compile(rf"^({_DOTTED}):({_DOTTED})$")  # module:Class, e.g. my_lab.models:MyPipeline
CLASS_REFERENCE_HINT = (
    "pass --pipeline MODULE:CLASS, e.g. --pipeline my_lab.models:MyPipeline (MODULE must be importable: "
    "installed, or on PYTHONPATH); see docs/reliability.md"
)


@dataclass(frozen=True)
class PipelineEntry:
    """A resolved pipeline: its name and the object that carries Config, observation_schema and the class."""

    name: str  # registered name, or the "module:Class" reference given on the command line
    module: Any  # an entry module, or (``--pipeline``) the pipeline class itself

    @property
    def is_class(self) -> bool:
        """True for a ``--pipeline module:Class`` entry."""
        return isinstance(self.module, type)

    @property
    def config_class(self) -> Any:
        return self.module.Config

    def observation_schema(self) -> Any:
        return self.module.observation_schema()

    def pipeline_class(self) -> type:
        """The pipeline class; for an entry module this imports torch and the model code."""
        return self.module if self.is_class else self.module.pipeline_class()


def called_without_instance(owner: Any, attr: str, exc: BaseException, *args: Any, **kwargs: Any) -> str | None:
    """The hint for ``owner.attr(*args, **kwargs)`` that raised ``TypeError`` because ``attr`` is a plain method
    (``def observation_schema(self)``): ardiff calls ``from_config`` and a class's ``observation_schema`` on the class,
    so Python said only "missing 1 required positional argument". None for any other failure, a ``TypeError`` raised
    inside the method included (its traceback runs through the method's code; a call that did not bind does not), and
    a call that would not bind with an instance either (a plain function of another signature: no decorator helps)."""
    method = inspect.getattr_static(owner, attr, None) if isinstance(owner, type) else None
    if not isinstance(exc, TypeError) or not isinstance(method, types.FunctionType):
        return None  # a classmethod or staticmethod raised TypeError itself
    if any(frame.f_code is method.__code__ for frame, _ in traceback.walk_tb(exc.__traceback__)):
        return None
    try:
        inspect.signature(method).bind(owner, *args, **kwargs)
    except TypeError:
        return None
    # @classmethod mends any call that binds with the class first; @staticmethod alone left `self` unfilled
    fix = "" if attr == "from_config" else ", or drop its first parameter and decorate it with @staticmethod"
    return (f"{owner.__qualname__}.{attr} is a plain method, but ardiff calls it on the class, with no instance: "
            f"decorate it with @classmethod{fix}, as pipelines.dreamzero.pipeline:DreamZeroPipeline does "
            "(README, 'Adding a pipeline')")


def registered_pipelines() -> dict[str, str]:
    """Pipeline name -> entry module path, built-ins first (an entry point cannot shadow a built-in: a warning
    says which one was left out). A name two distributions register goes to the one whose name sorts first, with
    a warning naming both (the order of entry_points() is the file system's listing order, so the first found
    would differ between machines)."""
    names = dict(BUILTIN_PIPELINES)
    found: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_PIPELINES:
            warnings.warn(f"entry point {ep.name} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} ({_origin(ep)}) has "
                          f"the name of a built-in pipeline and is ignored: {ep.name!r} is the built-in "
                          f"{BUILTIN_PIPELINES[ep.name]!r}; register it under another name", ArdiffWarning,
                          stacklevel=2)
            continue
        found.setdefault(ep.name, []).append(ep)
    for name, eps in found.items():
        used, *others = sorted(eps, key=lambda ep: (ep.dist is None, ep.dist.name.lower() if ep.dist else "",
                                                    ep.value))
        names[name] = used.value
        others = [ep for ep in others if ep.value != used.value]  # the same module twice is no conflict
        if others:
            ignored = "; ".join(f"{ep.value!r} ({_origin(ep)})" for ep in others)
            warnings.warn(f"pipeline {name!r} is registered by more than one entry point in group "
                          f"{ENTRY_POINT_GROUP!r}: {used.value!r} ({_origin(used)}) is used, {ignored} ignored (the "
                          "distribution whose name sorts first is used); uninstall one, or register it under "
                          "another name", ArdiffWarning, stacklevel=2)
    return names


def _origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"distribution {dist.name} {dist.version}" if dist is not None else "unknown distribution"


def _import(module_path: str, *, what: str, where: str):
    try:
        # memory running out names the import (`--pipeline MODULE:CLASS` imports here, before the engine's blocks
        # that name what ran: it read `out of host memory: MemoryError`)
        with running_out_of_memory_names(f"importing pipeline module {module_path!r}"):
            return importlib.import_module(module_path)
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever the module raised while importing
        if is_out_of_memory(exc):  # no room to load it (torch under `ulimit -v`): out of memory, not the install
            raise
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        shadowed = _shadowed(module_path)  # another `pipelines` in ardiff's place, whatever it raised
        if shadowed or missing is not None and (module_path == missing or module_path.startswith(f"{missing}.")):
            # The module named (or its package) is not there: the option or the install, the user's to fix.
            hint = ("is the package installed in this environment (or its folder on PYTHONPATH)?"
                    if not module_path.endswith(".py") else
                    f"{quoted(module_path)} is a file's name; MODULE is the name it is imported by: "
                    f"{module_path.removesuffix('.py')} (its folder on PYTHONPATH)")
            raise ConfigError(f"{where}: {what}: cannot import {module_path!r}: {type(exc).__name__}: {exc}",
                              hint=shadowed or hint) from None
        # Found, and raised as it ran (a syntax error, a RuntimeError at its top level, a dependency it imports that
        # is not installed): the pipeline's code failed as it loaded, as when an entry module's pipeline_class() fails.
        # It was a config error (exit 2), told "is the package installed?" for a missing dependency.
        package = module_path.partition(".")[0]
        if missing is None:
            hint = "fix the module"
        elif missing.startswith(f"{package}."):  # a module of its own package: no install gives it
            hint = (f"it imports {missing!r}, which its own package {package!r} does not hold: a file left out of "
                    "the package (or of its install), or a misspelt import")
        else:
            hint = f"it imports {missing!r}, which is not installed in this environment: install it"
        raise PipelineError(f"{where}: {what}: importing {module_path!r} raised {type(exc).__name__}: {exc}",
                            hint=f"{hint} (python -c 'import {module_path}' shows the traceback)") from None


def _file_path_hint(reference: str) -> str | None:
    """The hint for ``--pipeline dir/x.py:Class``, a file's path where MODULE is meant: the folder to put on
    PYTHONPATH and the name to import (``x.py:Class``, a name, is told so as it fails to import); None for a
    reference that is no file's path."""
    path, colon, qualname = reference.rpartition(":")
    if not colon:  # `--pipeline dir/x.py`, the class left out too
        path, qualname = reference, ""
    if "/" not in path:
        return None
    file = PurePosixPath(path)  # `dir/` is the package dir in the working folder; `dir//x.py` is `dir/x.py`
    cls = qualname if re.fullmatch(_DOTTED, qualname) else "CLASS"
    # `dir/..`, `/`: a folder, which the text does not name: it was told to rename "the file" '..', which is no Python
    # name; `dir/`, `~/` of a folder there (`dir/` of none is a package dir to be): told PYTHONPATH=. and --pipeline
    # dir:C, which imports no module of a plain folder, and `~/` to rename "the file" '~'
    if file.name in ("", "..") or os.path.isdir(os.path.expanduser(path)):
        return _folder_path_hint(path, cls)
    if file.name == "__init__.py":  # a package's own module: imported by its folder's name
        file = file.parent
    module = file.name.removesuffix(".py")
    said = f"{quoted(path)} is a file's path; MODULE is the name it is imported by, from a folder on PYTHONPATH"
    if not module.isidentifier():
        return f"{said}, and {quoted(module)} is no Python name: rename the file (letters, digits and _)"
    folder = os.path.expanduser(str(file.parent))  # `--pipeline=~/code/x.py:C`: no shell expands a ~ there
    return f"{said}: run with PYTHONPATH={shell_word(folder)} and --pipeline {module}:{cls}"


def _folder_path_hint(path: str, cls: str) -> str:
    """The hint for ``--pipeline dir/..:Class``: a path ending in ``..`` (or ``/``) names a folder, not a module file.
    A package folder (it holds ``__init__.py``) is imported by its name from the folder above it; any other folder
    goes on PYTHONPATH itself, and MODULE is one of its files."""
    folder = os.path.normpath(os.path.expanduser(path))  # `lab/models/..` is `lab`; `dir/..` is `.`
    # no name in the text (`.`, `..`, `/`): the folder's own, from its full path
    named = os.path.abspath(folder) if os.path.basename(folder) in ("", ".", "..") else folder
    name = os.path.basename(named)
    said = f"{quoted(path)} names a folder, not a module file; MODULE is the name a module is imported by"
    if name.isidentifier() and os.path.isfile(os.path.join(named, "__init__.py")):
        above = os.path.dirname(named) or "."
        return (f"{said}: {as_typed(named)} is a package: run with PYTHONPATH={shell_word(above)} and --pipeline "
                f"{name}:{cls} (or {name}.MODULE:{cls} for one of its modules)")
    return (f"{said}, from a folder on PYTHONPATH: run with PYTHONPATH={shell_word(folder)} and --pipeline "
            f"MODULE:{cls}, MODULE the name of a .py file in that folder, without .py")


def _shadowed(module_path: str) -> str | None:
    """Why a built-in pipeline did not import, when another ``pipelines`` package was imported in place of ardiff's:
    ``python -m ardiff_cli`` puts the working folder first on ``sys.path``, and a ``pipelines/`` folder there (a
    lab's own code) hides the one installed beside ``ardiff_cli``."""
    import importlib.util
    import sys

    if not module_path.startswith("pipelines."):
        return None
    package = sys.modules.get("pipelines")
    if package is None:  # one whose __init__ raised is not kept there: where it would be imported from
        try:
            package = importlib.util.find_spec("pipelines")
        except (ImportError, ValueError):
            package = None
    folders = [Path(p).resolve() for p in getattr(package, "submodule_search_locations", None)
               or getattr(package, "__path__", None) or ()]
    ours = Path(__file__).resolve().parents[2] / "pipelines"  # beside ardiff_cli/, installed or checked out
    if not folders or ours in folders:
        return None
    return (f"'pipelines' was imported from {folders[0]}, not ardiff's ({ours}): a folder named pipelines earlier "
            "on sys.path hides it (the working folder, under `python -m ardiff_cli` or `PYTHONPATH=.`, or a "
            "PYTHONPATH entry); rename that folder, or run from another one without it on PYTHONPATH")


def resolve_entry_module(module_path: str, *, name: str, where: str) -> PipelineEntry:
    if ":" in module_path:  # `my_world = "my_lab.models:MyPipeline"`, as console scripts are registered
        module, _, attr = module_path.partition(":")
        raise ConfigError(
            f"{where}: pipeline {name!r}: its entry point in group {ENTRY_POINT_GROUP!r} is {module_path!r}, an object "
            f"({attr.strip()!r} in module {module.strip()!r}); an {ENTRY_POINT_GROUP} entry point names a module",
            hint=f"register the torch-free module that defines {', '.join(ENTRY_ATTRS)} ({name} = "
                 f"\"{module.strip()}\" if it is that one) and reinstall the package (README, 'Adding a pipeline'); "
                 f"to run a pipeline class as it is: --pipeline {module_path}")
    module = _import(module_path, what=f"pipeline {name!r}", where=where)
    missing = [attr for attr in ENTRY_ATTRS if not hasattr(module, attr)]
    if missing:
        raise ConfigError(f"{where}: pipeline module {module_path!r} lacks {', '.join(missing)}",
                          hint=f"an entry module defines {', '.join(ENTRY_ATTRS)} "
                               "(see pipelines/dreamzero/__init__.py)")
    return PipelineEntry(name=name, module=module)


def resolve_pipeline(name: str, *, where: str = "config") -> PipelineEntry:
    """A registered pipeline by name: what a config's ``pipeline:`` field may say."""
    registry = registered_pipelines()
    if name not in registry:
        if ":" in name:
            raise ConfigError(
                f"{where}: field 'pipeline': {name!r} is not a registered pipeline; a config names registered "
                "pipelines only, so that reading a config never imports code",
                hint=f"registered pipelines: {', '.join(sorted(registry))}; to load a class from a module, "
                     f"{CLASS_REFERENCE_HINT}",
            )
        hint = f"registered pipelines: {', '.join(sorted(registry))}"
        # `pipeline: my_world` from README's example before it was registered; a typo of a registered name
        # (`dreamzeor`, `causal-world`) is told that name, not how to register one's own
        if where != "--pipeline" and close_match(name, registry, cutoff=0.8) is None:
            hint += (f"; a pipeline of your own gets its name from an {ENTRY_POINT_GROUP!r} entry point of its "
                     "installed package (README, 'Adding a pipeline'); until then, pass its class with --pipeline "
                     "MODULE:CLASS (in Python: load_config(CONFIG, pipeline='MODULE:CLASS'))")
        if where == "--pipeline":  # `my_lab.models.MyPipeline` (an import path) or `my_lab.models` (no class)
            module, _, last = name.rpartition(".")
            example = f"{module}:{last}" if module and last[:1].isupper() else "my_lab.models:MyPipeline"
            hint += f"; to load a class from a module, write MODULE:CLASS, e.g. --pipeline {example}"
        raise ConfigError(
            f"{where}: field 'pipeline': unknown pipeline {quoted(name)}{did_you_mean(name, registry)}", hint=hint
        )
    return resolve_entry_module(registry[name], name=name, where=where)


def resolve_pipeline_reference(reference: str) -> PipelineEntry:
    """What ``--pipeline`` may say: a registered name, or ``module:Class`` (imports ``module``)."""
    where = "--pipeline"
    if not isinstance(reference, str) or not reference.strip():
        raise ConfigError(f"{where}: expected a registered pipeline name or MODULE:CLASS, got {quoted(reference)}",
                          hint=CLASS_REFERENCE_HINT)
    reference = reference.strip()
    if ":" not in reference and "/" not in reference:  # a file's path (`dir/x.py`) is told so below
        return resolve_pipeline(reference, where=where)
    match = CLASS_REFERENCE.match(reference)
    if match is None:
        raise ConfigError(f"{where}: expected MODULE:CLASS (dotted Python names), got {quoted(reference)}",
                          hint=_file_path_hint(reference) or CLASS_REFERENCE_HINT)
    module_path, qualname = match.groups()
    module = _import(module_path, what=f"pipeline {reference!r}", where=where)
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            classes = [n for n, v in vars(obj).items() if isinstance(v, type) and not n.startswith("_")]
            raise ConfigError(
                f"{where}: {module_path!r} has no attribute {qualname!r}{did_you_mean(part, classes)}",
                hint=f"classes in {module_path}: {', '.join(sorted(classes)) or 'none'}",
            )
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ConfigError(f"{where}: {reference!r} is a {type(obj).__name__}, expected a pipeline class",
                          hint=CLASS_REFERENCE_HINT)
    missing = [attr for attr in CLASS_ATTRS if not hasattr(obj, attr)]
    if missing:
        raise ConfigError(
            f"{where}: {reference!r} is not a pipeline class: it lacks {', '.join(missing)}",
            hint="a --pipeline class carries what an entry module carries: class attributes Config (the model "
                 "config dataclass) and observation_schema (a staticmethod), plus from_config() and the "
                 "AR-Diffusion capability methods; subclass pipelines.dreamzero.pipeline.DreamZeroPipeline for "
                 "an example",
        )
    return PipelineEntry(name=reference, module=obj)
