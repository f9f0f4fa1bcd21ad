"""The request fields that ask for structured output, mapped to vLLM's `structured_outputs` (SamplingParams):
OpenAI's `response_format`, vLLM's `structured_outputs` and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. At most one of them per request. Torch-free: the grammars compile on the
nodes (engine/structured_output.py); here only what is cheap is checked, so that the common mistakes (a
schema that is not a JSON object, a regex that does not compile) are a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

from pdcluster.control.sampling_params import STRUCTURED_OUTPUT_KINDS
from pdcluster.router.errors import bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_outputs_of(req: Any) -> dict[str, Any] | None:
    """The request's `structured_outputs` dict (one of STRUCTURED_OUTPUT_KINDS), or None; 400 on a bad one."""
    asked: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        asked.append(("structured_outputs", _from_structured_outputs(structured)))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name, None)
        if value is not None:
            asked.append((name, {kind: value}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"only one of response_format, structured_outputs and guided_* may be set, got {names}",
                          param=asked[1][0])
    field, spec = asked[0]
    _check(field, spec)
    return spec


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a type", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        wrapper = value.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if schema is None and isinstance(wrapper, dict):   # no schema given: any JSON object (as OpenAI)
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              param="response_format.json_schema")
        return {"json": schema}
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}",
                      param="response_format.type")


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", param="structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(k for k in given if k not in STRUCTURED_OUTPUT_KINDS)
    if unknown:
        raise bad_request(f"structured_outputs: unsupported key(s) {unknown}; supported: "
                          f"{list(STRUCTURED_OUTPUT_KINDS)}", param="structured_outputs")
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {list(STRUCTURED_OUTPUT_KINDS)}",
                          param="structured_outputs")
    return given


def _check(field: str, spec: dict[str, Any]) -> None:
    (kind, value), = spec.items()
    param = field if field.startswith("guided_") or field == "response_format" else f"{field}.{kind}"
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param}: not valid JSON: {exc}", param=param) from None
        spec[kind] = value
    if kind == "json" and not isinstance(value, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param)
    if kind == "json":
        _check_schema(value, param)
    if kind == "regex":
        if not isinstance(value, str):
            raise bad_request(f"{param} must be a string", param=param)
        try:
            re.compile(value)
        except (re.error, OverflowError, RecursionError, ValueError) as exc:
            raise bad_request(f"{param}: invalid regular expression: {exc}", param=param) from None
    if kind == "choice" and (not isinstance(value, list) or not value
                             or not all(isinstance(c, str) and c for c in value)):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param=param)
    if kind == "grammar" and (not isinstance(value, str) or "::=" not in value):
        raise bad_request(f"{param} must be an EBNF grammar (rules like root ::= ...)", param=param)


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """The meta-schema check when jsonschema is installed (torch-free); xgrammar has the last word."""
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(f"{param}: invalid JSON schema: {exc.message}", param=param) from None
    except Exception as exc:   # a schema odd enough to trip the checker itself (a non-string "$schema", ...)
        raise bad_request(f"{param}: invalid JSON schema: {exc}", param=param) from None
