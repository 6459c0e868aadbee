"""Check one step file against a pipeline's ``ObservationSchema`` before it reaches the model.

File-level concerns live here: where the prompt comes from (the file's
metadata, else ``episode.yaml``) and extra keys a recording carries
(timestamps, other sensors), which are ignored with a warning instead of
failing the file. The array checks themselves (key, dtype and shape, expected
versus got, every problem at once) are the shared validator the pipelines also
run on ``request.inputs``, so a file and a Python request fail alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ardiff_cli.runtime.errors import ObservationError, as_typed, close_match, did_you_mean, plural, shown
from ardiff_cli.runtime.observation import ObservationSchema

from ardiff_cli.io.episode import METADATA_FILE, listed
from ardiff_cli.io.step_file import RawStep

MAX_NAMED_KEYS = 10  # keys outside the schema named one by one in a warning or an error; the rest are counted
# a foreign file's arrays kept for the closing hint up to this many: a file of 200,000 keys is no schema's, and kept for
# each of 500 episodes it held the run's memory
MAX_LAYOUT_KEYS = 64
RIGHT_CONFIG = "is this the right CONFIG? A recording made for another pipeline holds that pipeline's keys"


class ForeignRecording(ObservationError):
    """A step file holding arrays, none of them in the pipeline's schema nor near one of its keys (a misspelt key is a
    bad file), before any step of its episode ran (after, it is a bad file: ``validate_step``'s ``midway``): a
    recording made for another pipeline. No edit of the file fixes it, nor a ``--resume`` (which keeps the run's
    config): a run with the recording's config does, so a run whose failures are all of this kind hints that rather
    than its resume. ``layout``: the file's arrays, key -> (dtype name, shape), by which the run's closing hint names
    the built-in config whose schema takes them (None: more arrays than any schema has fields)."""

    def __init__(self, message: str, *, hint: str | None = None, arrays: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint=hint)  # defaults: copy.copy (naming_episode) calls it with the message alone
        self.layout = None if arrays is None or len(arrays) > MAX_LAYOUT_KEYS else {
            k: (getattr(getattr(v, "dtype", None), "name", type(v).__name__), tuple(getattr(v, "shape", ())))
            for k, v in arrays.items()}


@dataclass(slots=True)
class ValidStep:
    inputs: dict[str, Any]  # canonical key -> numpy array, plus the prompt under schema.prompt_key
    warnings: dict[str, str] = field(default_factory=dict)  # an extra key (ignored) -> the warning about it


def validate_step(raw: RawStep, schema: ObservationSchema, *, path: Path,
                  episode_metadata: dict[str, Any], midway: bool = False) -> ValidStep:
    """Canonical inputs for the model, or an ``ObservationError`` naming ``path`` and every problem. ``midway``: steps
    of the episode ran before this file, so one holding none of the schema's arrays is a bad file, not a recording
    made for another pipeline (``ForeignRecording``, hinting ``is this the right CONFIG?``); nor is one holding a key
    near one of the schema's (misspelt)."""
    from ardiff_cli.runtime.observation import lone_surrogate, validate_observation

    prompt_keys = (schema.prompt_key, *schema.prompt_aliases) if schema.prompt_key else ()
    field_keys = {k: f.name for f in schema.fields for k in f.keys}  # each key -> its field: aliases count once
    arrays = {k: v for k, v in raw.arrays.items() if k in field_keys or k in prompt_keys}
    extra = sorted(k for k in raw.arrays if k not in arrays)
    # Named one by one up to a limit: a file of 200,000 other arrays printed 200,000 warning lines (or an error of
    # 2 MB), and looking for a did-you-mean of each took seconds a step.
    ignored = {k: did_you_mean(k, field_keys, stands_for=field_keys) for k in extra[:MAX_NAMED_KEYS]}
    more = extra[MAX_NAMED_KEYS:]
    warnings = {k: f"{as_typed(path)}: key {k!r} is not in the pipeline's schema; ignored{near}"
                for k, near in ignored.items()}
    if more:  # under the first of them: said once for the episode, as each named key is
        warnings[more[0]] = (f"{as_typed(path)}: {plural(len(more), 'more key')} not in the pipeline's schema "
                             f"({listed([repr(k) for k in more])}); ignored")
    and_more = f" and {len(more)} more" if more else ""
    prompt_missing = False
    if schema.prompt_key and not any(k in arrays for k in prompt_keys):
        for source in (raw.metadata, episode_metadata):
            keys = [k for k in prompt_keys if k in source]
            key = keys[0] if keys else None
            if key is not None:
                where = path if source is raw.metadata else path.parent / METADATA_FILE
                other = next((k for k in keys[1:] if source[k] != source[key]), None)
                if other is not None:  # a converter that copied 'language_instruction' and set 'prompt' apart
                    raise ObservationError(
                        f"{where}: prompt given twice, differently: {key!r} is {shown(source[key])}, {other!r} is "
                        f"{shown(source[other])}",
                        hint="keep one of them: ardiff does not choose which task the episode runs")
                if source is not raw.metadata and not isinstance(source[key], str):
                    # YAML types `prompt: 5` or `prompt:` (null): name the file it is in, not the step file
                    raise ObservationError(
                        f"{path.parent / METADATA_FILE}: field {key!r}: expected the prompt as text, got "
                        f"{shown(source[key])}",
                        hint=f"write it as one line of text, quoted if YAML would read it as something else: "
                             f"{key}: \"pick up the red cube\"")
                if source is not raw.metadata and (surrogate := lone_surrogate(source[key])) is not None:
                    # YAML's "\udcff" escape: no tokenizer takes it; name the file it is in
                    raise ObservationError(
                        f"{path.parent / METADATA_FILE}: field {key!r}: the prompt {surrogate}",
                        hint=f"write the prompt as plain UTF-8 text, without \\udcXX escapes: {key}: \"pick up the "
                             "red cube\"")
                arrays[key] = source[key]
                break
        else:
            _refuse_a_misspelt_prompt(path, prompt_keys, raw.metadata, episode_metadata)
            prompt_missing = True
    # no array of the schema, none misspelt, and no step of its episode ran: a recording made for another pipeline
    foreign = not midway and not field_keys.keys() & arrays.keys() and not any(ignored.values())
    try:
        inputs = validate_observation(schema, arrays, where=str(path))
    except ObservationError as exc:
        if prompt_missing:  # the schema's hint lists the prompt among the fields, as if it were one more array
            exc.hint = (f"{exc.hint}; put `{schema.prompt_key}: ...` in {path.parent / METADATA_FILE} for the whole "
                        "episode, or in a step file's metadata")
        if ignored:  # what the file holds instead (a misspelt key): its warning never shows for a failed file
            others = ", ".join(repr(k) + near for k, near in ignored.items()) + and_more
            message = f"{exc}; the file's other keys, not in the schema: {others}"
            if foreign:
                raise ForeignRecording(message, hint=f"{exc.hint}; {RIGHT_CONFIG}", arrays=raw.arrays) from None
            raise ObservationError(message, hint=exc.hint) from None
        raise
    if ignored and not field_keys.keys() & arrays.keys():  # every field optional, and the file holds none of them
        fields = ", ".join(f"{f.name!r}" + (f" ({', '.join(map(repr, f.aliases))})" if f.aliases else "")
                           for f in schema.fields)
        held = ", ".join(repr(k) + near for k, near in ignored.items()) + and_more
        message = (f"{as_typed(path)}: none of the file's arrays ({held}) is in the pipeline's schema ({fields}): the "
                   "model would run on the prompt alone")
        if not foreign:
            raise ObservationError(message, hint=None if midway else RIGHT_CONFIG)
        raise ForeignRecording(message, hint=RIGHT_CONFIG, arrays=raw.arrays)
    return ValidStep(inputs=inputs, warnings=warnings)


def _refuse_a_misspelt_prompt(path: Path, prompt_keys: tuple[str, ...], *sources: dict[str, Any]) -> None:
    """No prompt anywhere, but a key close to one (``promt:`` in episode.yaml): an error that names the key and
    where it is. The schema's own "missing prompt" said nothing of it, and other keys there are never read."""
    for source, where in zip(sources, (path, path.parent / METADATA_FILE)):
        for key in source:
            near = close_match(str(key), prompt_keys, stands_for=dict.fromkeys(prompt_keys, prompt_keys[0]))
            if near is not None:  # the hint names the key the did-you-mean does, not always the first prompt key
                raise ObservationError(f"{as_typed(path)}: missing prompt {' or '.join(map(repr, prompt_keys))}; "
                                       f"{where} has {shown(key)} (did you mean {near!r}?)",
                                       hint=f"rename that key to {near!r}")
