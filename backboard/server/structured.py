"""A request's structured-output fields -> one StructuredOutputsParams, or a 400 naming the field.

Accepted (at most one per request):
    response_format      OpenAI: {"type": "json_object"} | {"type": "json_schema", "json_schema":
                         {"name": ..., "schema": {...}, "strict": true}} | {"type": "text"} (none)
    guided_json          vLLM: a JSON schema (object or JSON text)
    guided_regex, guided_choice, guided_grammar (EBNF, or Lark)
    structured_outputs   vLLM's newer object: {"json" | "regex" | "choice" | "grammar" |
                         "json_object" | "structural_tag": ...}
Schemas are checked by building their grammar (no tokenizer needed), so a bad one fails here."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from backboard.sample.grammar import GrammarError, check_structured_outputs
from backboard.sampling_params import GRAMMAR_KINDS, StructuredOutputsParams
from backboard.server.errors import bad_request

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs")
# vLLM's structured_outputs options that change nothing here
_IGNORED_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                    "whitespace_pattern", "backend"}


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or JSON text of one) as compact JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from e
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def structured_spec(req: Any) -> StructuredOutputsParams | None:
    """The request's constraint (None: unconstrained); raises APIError 400 naming the field."""
    given = [(f, getattr(req, f, None)) for f in FIELDS]
    given = [(f, v) for f, v in given if v is not None and not _is_text_format(f, v)]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"only one of {', '.join(f for f, _ in given)} may be given", given[1][0])
    field, value = given[0]
    try:
        so = _build(field, value)
        check_structured_outputs(so, field)
    except GrammarError as e:
        raise bad_request(str(e), field) from e
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from e
    return so


def _is_text_format(field: str, value: Any) -> bool:
    return field == "response_format" and isinstance(value, dict) and value.get("type") == "text"


def _build(field: str, value: Any) -> StructuredOutputsParams:
    if field == "response_format":
        return _response_format(value)
    if field == "guided_json":
        return StructuredOutputsParams(json=schema_text(value, field))
    if field == "guided_regex":
        return StructuredOutputsParams(regex=_text(value, field))
    if field == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request("guided_choice must be a non-empty list of strings", field)
        return StructuredOutputsParams(choice=list(value))
    if field == "guided_grammar":
        return StructuredOutputsParams(grammar=_text(value, field))
    return _structured_outputs(value)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field} must be a non-empty string", field)
    return value


def _response_format(rf: Any) -> StructuredOutputsParams:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise bad_request("response_format.json_schema needs a 'schema'", "response_format")
        return StructuredOutputsParams(json=schema_text(js["schema"], "response_format"))
    raise bad_request(f"response_format.type must be text, json_object or json_schema; got {kind!r}",
                      "response_format")


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(value) - set(GRAMMAR_KINDS) - _IGNORED_OPTIONS)
    if unknown:
        raise bad_request(f"structured_outputs: unknown field(s) {unknown}; known: {list(GRAMMAR_KINDS)}",
                          "structured_outputs")
    kw = {k: value[k] for k in GRAMMAR_KINDS if value.get(k) is not None}
    if "json" in kw:
        kw["json"] = schema_text(kw["json"], "structured_outputs")
    if "structural_tag" in kw and not isinstance(kw["structural_tag"], str):
        kw["structural_tag"] = json.dumps(kw["structural_tag"])
    return StructuredOutputsParams(**kw)


def with_reasoning_gate(so: StructuredOutputsParams | None, think_token_ids: tuple[int, int] | None,
                        think_open: bool) -> StructuredOutputsParams | None:
    """The spec with the grammar held off during the reasoning block (see RequestGrammar)."""
    if so is None or think_token_ids is None:
        return so
    return replace(so, think_token_ids=think_token_ids, think_open=think_open)

