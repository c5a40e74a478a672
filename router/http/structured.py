"""Structured output in the HTTP APIs: OpenAI's `response_format` and TGI's `grammar` as a `Grammar`.

Each is checked once here (router/grammar.py: the replicas' library, without a tokenizer) and a
grammar that does not compile is a 400 naming the field, in the route's error format; nothing is
queued. The replicas then mask every token that would leave the grammar, so `json_schema` output
validates against its schema and `json_object` output is one JSON object (when the token allowance
lets it finish: `finish_reason` says "length" otherwise).
"""

from __future__ import annotations

import json
from typing import Any

from router.grammar import grammar_error
from router.http.errors import APIError, Flavor
from router.http.schemas import ResponseFormat, TGIGrammar
from router.types import Grammar, GrammarKind


def checked(grammar: Grammar, flavor: Flavor, param: str) -> Grammar:
    """`grammar` if it compiles; else a 400 naming `param`."""
    error = grammar_error(grammar)
    if error is not None:
        raise APIError(f"`{param}` is not a valid {grammar.kind.value}: {error}", 400, flavor, param)
    return grammar


def schema_grammar(schema: dict[str, Any], flavor: Flavor, param: str) -> Grammar:
    """A JSON Schema as a checked grammar (the properties keep the client's order)."""
    return checked(Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema)), flavor, param)


def openai_grammar(fmt: ResponseFormat | None) -> Grammar | None:
    """OpenAI `response_format`: None for text, any object for json_object, the schema for json_schema."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise APIError("`json_schema` needs type json_schema", 400, param="response_format.json_schema")
        return None
    if fmt.type == "json_object":
        return Grammar(GrammarKind.JSON_OBJECT)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            "response_format of type json_schema needs `json_schema.schema`",
            400,
            param="response_format.json_schema.schema",
        )
    return schema_grammar(fmt.json_schema.schema_, Flavor.OPENAI, "response_format.json_schema.schema")


def tgi_grammar(grammar: TGIGrammar | None) -> Grammar | None:
    """TGI `grammar`: type json (a schema, as an object or as JSON text) or regex (a string)."""
    if grammar is None:
        return None
    param = "grammar.value"
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise APIError("a regex grammar's value must be a string", 400, Flavor.TGI, param)
        return checked(Grammar(GrammarKind.REGEX, grammar.value), Flavor.TGI, param)
    schema: Any = grammar.value
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise APIError(f"a json grammar's value is not JSON: {exc}", 400, Flavor.TGI, param) from None
    if not isinstance(schema, dict):
        raise APIError("a json grammar's value must be a JSON Schema object", 400, Flavor.TGI, param)
    return schema_grammar(schema, Flavor.TGI, param)
