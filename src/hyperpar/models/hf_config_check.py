"""Name the field of a config.json that a family's ``from_hf_config`` could not read.

``int("big")`` says ``invalid literal for int()``, not which of fifty fields held "big". On that
error path the config is compared with a known-good config of the same family (a flavour's
``to_hf_config()``): the first field whose kind of value differs (number, text, list, mapping,
true/false) is the one named.
"""

from __future__ import annotations

from typing import Any

from hyperpar.errors import CheckpointError


def _kind(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "text"
    if isinstance(v, (list, tuple)):
        return "list"
    if isinstance(v, dict):
        return "mapping"
    return type(v).__name__


def mistyped_field(config: dict[str, Any], reference: dict[str, Any], prefix: str = "") -> tuple[str, Any, str] | None:
    """(dotted key, its value, the kind expected) of the first field of another kind than the reference's."""
    for key, value in config.items():
        ref = reference.get(key)
        if key == "text_config" and ref is None:
            ref = reference  # a composite config's text part against a text-only reference
        got, want = _kind(value), _kind(ref)
        if got is None or want is None:
            continue
        if got != want and not (got == "number" and want == "true/false"):
            return f"{prefix}{key}", value, want
        if got == "mapping":
            found = mistyped_field(value, ref, f"{prefix}{key}.")
            if found is not None:
                return found
    return None


def config_read_error(where: str, config: dict[str, Any], reference: dict[str, Any] | None, exc: Exception) -> CheckpointError:
    found = mistyped_field(config, reference) if reference else None
    if found is not None:
        key, value, want = found
        return CheckpointError(f"{where}: field '{key}' is {value!r}, expected a {want}",
                               hint="fix that field of the config.json")
    return CheckpointError(f"{where}: cannot read the model geometry ({type(exc).__name__}: {exc})",
                           hint="check its fields against a config.json of the same model family")
