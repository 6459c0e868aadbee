"""Observation schemas: what a pipeline accepts in one step file. No torch import.

A pipeline declares its schema; the CLI validates every step file against it
before anything reaches the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ObservationField:
    """One array (or the prompt) of a robot observation.

    ``shapes`` lists the accepted shapes; ``None`` in a shape is any positive
    size (for example image height and width). ``aliases`` are other key
    conventions (RoboArena, DROID) that mean the same field.
    """

    name: str  # canonical key
    dtype: str  # numpy dtype name: "uint8", "float32", ... ("str" for text)
    shapes: tuple[tuple[int | None, ...], ...]  # accepted shapes
    aliases: tuple[str, ...] = ()  # other accepted keys
    required: bool = True  # missing optional fields are simply absent
    description: str = ""  # one line for docs and error hints

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True, slots=True)
class ObservationSchema:
    """The fields of one step, plus the text prompt (carried as metadata)."""

    fields: tuple[ObservationField, ...]
    prompt_key: str = "prompt"  # metadata key of the language prompt; "" when the pipeline takes none
    prompt_aliases: tuple[str, ...] = ()

    def field(self, key: str) -> ObservationField | None:
        """The field a key (canonical or alias) names, or None."""
        for f in self.fields:
            if key in f.keys:
                return f
        return None
