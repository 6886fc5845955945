"""Check `/v1/responses` payloads against the Open Responses OpenAPI document.

`/v1/responses` is meant to follow the Open Responses spec. These helpers validate its
payloads with the spec's own schemas, taken from the copy in
`tests/data/openresponses/openapi.json`, so a field the spec requires cannot go missing
without a test noticing. Hand-written assertions check only the fields their authors
thought of.

The document is OpenAPI 3.1. Its schemas are JSON Schema 2020-12, so they are used as
they are. Keywords that are only annotations (`discriminator`, `example`, `x-*`) are
ignored. Each helper returns a list of messages and an empty list means valid, so a test
can `assert not response_errors(body), response_errors(body)`.

    from tests.openresponses_spec import event_errors, response_errors
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).parent / "data" / "openresponses" / "openapi.json"
_SPEC_URI = "urn:openresponses:openapi"
_MAX_MESSAGE = 300  # jsonschema repeats the whole instance in some messages


@functools.cache
def spec() -> dict[str, Any]:
    """The parsed OpenAPI document, read once per test session."""
    return json.loads(SPEC_PATH.read_text(encoding="utf-8"))


@functools.cache
def _registry() -> Registry:
    """The document as one resource, so `#/components/schemas/...` refs resolve inside it."""
    return Registry().with_resource(_SPEC_URI, Resource(spec(), DRAFT202012))


@functools.cache
def _validator(component: str) -> Draft202012Validator:
    if component not in spec()["components"]["schemas"]:
        raise KeyError(f"the Open Responses spec has no schema {component!r}")
    ref = {"$ref": f"{_SPEC_URI}#/components/schemas/{component}"}
    return Draft202012Validator(ref, registry=_registry())


@functools.cache
def event_components() -> dict[str, str]:
    """Map each streaming event `type` to its schema name.

    The map comes from the `text/event-stream` union of `POST /responses`.
    """
    media = spec()["paths"]["/responses"]["post"]["responses"]["200"]["content"]
    schemas = spec()["components"]["schemas"]
    by_type: dict[str, str] = {}
    for member in media["text/event-stream"]["schema"]["oneOf"]:
        name = member["$ref"].rsplit("/", 1)[1]
        for kind in schemas[name]["properties"]["type"]["enum"]:
            by_type[kind] = name
    return by_type


def _rules_out(error: ValidationError) -> bool:
    """Whether an error shows that a union member describes some other kind of value.

    That is the case when the member expects another JSON type, or a `type` field with
    another value.
    """
    if error.validator == "type" and not error.path:
        return True
    return list(error.path) == ["type"] and error.validator in ("enum", "const")


def _leaves(error: ValidationError) -> list[ValidationError]:
    """Replace a failed `oneOf`/`anyOf` with the errors of the member that was meant.

    A failed union otherwise reports only "is not valid under any of the given schemas".
    When exactly one member is plausible for the value, its errors are reported instead.
    """
    if error.validator not in ("oneOf", "anyOf") or not error.context:
        return [error]
    members: dict[object, list[ValidationError]] = {}
    for sub in error.context:
        members.setdefault(sub.relative_schema_path[0], []).append(sub)
    plausible = [subs for subs in members.values() if not any(map(_rules_out, subs))]
    if len(plausible) != 1:
        return [error]
    return [leaf for sub in plausible[0] for leaf in _leaves(sub)]


def _describe(error: ValidationError) -> str:
    message = error.message
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return f"{error.json_path}: {message}"


def schema_errors(component: str, instance: Any) -> list[str]:
    """Validation errors of `instance` against `#/components/schemas/<component>`."""
    found = _validator(component).iter_errors(instance)
    leaves = [leaf for error in found for leaf in _leaves(error)]
    return sorted({_describe(leaf) for leaf in leaves})


def response_errors(obj: dict[str, Any]) -> list[str]:
    """Validation errors of a whole Response object (the spec's `ResponseResource`)."""
    return schema_errors("ResponseResource", obj)


def event_errors(event: dict[str, Any]) -> list[str]:
    """Validation errors of one streaming event.

    The event is checked against the union member whose `type` it names. An event of a
    type the spec does not define is reported as an error.
    """
    if not isinstance(event, dict):
        return [f"$: a streaming event must be an object, not {type(event).__name__}"]
    kind = event.get("type")
    component = event_components().get(kind) if isinstance(kind, str) else None
    if component is None:
        return [f"$.type: {kind!r} is not a streaming event type of the Open Responses spec"]
    return schema_errors(component, event)
