"""What a request asks its output to match, in each API's own fields, as one
`GrammarSpec` (shared/messages/grammar.py): OpenAI's `response_format`, vLLM's
`guided_*`, SGLang's `json_schema` / `regex` / `ebnf` / `structural_tag`. At most one
constraint per request; a malformed one is a 400 naming the field, and whether it
compiles is the executor's to say before the request queues (grammar_checks.py).

`any_whitespace` False (the server's `--constrained-json-disable-any-whitespace`, as
SGLang names it): JSON is written in xgrammar's compact form, so its length is bounded
by the schema; True lets the model put whitespace where JSON allows it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from msgspec import Meta, Struct

from services.scheduler.records.sampling import InvalidRequest
from shared.messages.grammar import MAX_GRAMMAR_SOURCE, GrammarKind, GrammarSpec

Source = Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_SOURCE)]
ANY_OBJECT = '{"type": "object"}'


class JsonSchemaFormat(Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`: `schema` absent is any JSON object.
    `strict` is accepted either way: the output always matches (xgrammar)."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextResponse(Struct, tag_field="type", tag="text"):
    """No constraint (OpenAI's default)."""


class JsonObjectResponse(Struct, tag_field="type", tag="json_object"):
    """Any JSON object."""


class JsonSchemaResponse(Struct, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaFormat


class StructuralTagResponse(Struct, tag_field="type", tag="structural_tag", kw_only=True):
    """xgrammar's structural tag (SGLang's and vLLM's `response_format` type): `format`
    is the tag's format object, as xgrammar documents it."""

    format: dict[str, Any]


ResponseFormat = TextResponse | JsonObjectResponse | JsonSchemaResponse | StructuralTagResponse


def _spec(kind: GrammarKind, source: str, field: str, any_whitespace: bool) -> GrammarSpec:
    if len(source) > MAX_GRAMMAR_SOURCE:
        raise InvalidRequest(f"{field} is {len(source)} characters (at most {MAX_GRAMMAR_SOURCE})")
    return GrammarSpec(kind=kind, source=source, any_whitespace=any_whitespace)


def _schema_text(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as err:
            raise InvalidRequest(f"{field} is not JSON: {err}") from err
    if not isinstance(schema, dict | bool):
        raise InvalidRequest(f"{field} must be a JSON schema (an object)")
    return json.dumps(schema)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF matching exactly one of `choices` (vLLM's guided_choice)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def one(specs: dict[str, GrammarSpec | None]) -> GrammarSpec | None:
    """The one constraint given, by field; two or more are a 400 naming them."""
    given = {name: spec for name, spec in specs.items() if spec is not None}
    if len(given) > 1:
        raise InvalidRequest(f"give at most one output constraint, not {sorted(given)}")
    return next(iter(given.values()), None)


def openai_constraint(body: Any, any_whitespace: bool) -> GrammarSpec | None:
    """The constraint of an OpenAI body: `response_format` or one of vLLM's `guided_*`."""
    fmt: ResponseFormat | None = body.response_format
    from_format = None
    if isinstance(fmt, JsonObjectResponse):
        from_format = _spec("json_schema", ANY_OBJECT, "response_format", any_whitespace)
    elif isinstance(fmt, JsonSchemaResponse):
        schema = fmt.json_schema.schema
        text = ANY_OBJECT if schema is None else _schema_text(schema, "json_schema.schema")
        from_format = _spec("json_schema", text, "response_format", any_whitespace)
    elif isinstance(fmt, StructuralTagResponse):
        tag = json.dumps({"type": "structural_tag", "format": fmt.format})
        from_format = _spec("structural_tag", tag, "response_format", any_whitespace)
    guided_json = body.guided_json
    return one(
        {
            "response_format": from_format,
            "guided_json": None
            if guided_json is None
            else _spec(
                "json_schema",
                _schema_text(guided_json, "guided_json"),
                "guided_json",
                any_whitespace,
            ),
            "guided_regex": _given("regex", body.guided_regex, "guided_regex", any_whitespace),
            "guided_choice": None
            if body.guided_choice is None
            else _spec("ebnf", choice_grammar(body.guided_choice), "guided_choice", any_whitespace),
            "guided_grammar": _given("ebnf", body.guided_grammar, "guided_grammar", any_whitespace),
        }
    )


def sglang_constraint(sampling: Any, any_whitespace: bool) -> GrammarSpec | None:
    """The constraint of SGLang's sampling parameters (each a string, as SGLang takes
    them: `json_schema` a schema's JSON text, `structural_tag` a structural tag's)."""
    schema = sampling.json_schema
    return one(
        {
            "json_schema": None
            if schema is None
            else _spec(
                "json_schema",
                _schema_text(schema, "sampling_params.json_schema"),
                "sampling_params.json_schema",
                any_whitespace,
            ),
            "regex": _given("regex", sampling.regex, "sampling_params.regex", any_whitespace),
            "ebnf": _given("ebnf", sampling.ebnf, "sampling_params.ebnf", any_whitespace),
            "structural_tag": _given(
                "structural_tag",
                sampling.structural_tag,
                "sampling_params.structural_tag",
                any_whitespace,
            ),
        }
    )


def _given(
    kind: GrammarKind, source: str | None, field: str, any_whitespace: bool
) -> GrammarSpec | None:
    return None if source is None else _spec(kind, source, field, any_whitespace)


GuidedChoice = Annotated[
    list[Annotated[str, Meta(min_length=1, max_length=4096)]], Meta(min_length=1, max_length=256)
]
