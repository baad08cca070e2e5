"""OpenAPI post-processing: say in the schema what DRF enforces on every string.

DRF's CharField refuses NUL characters (and JSON cannot carry lone surrogates through to the database),
so every free-text string in the schema gets a pattern that excludes them; a client generating input
from the schema (schemathesis does) then never sends a value the API must refuse. Strings that already
carry a pattern, an enum or a format (dates, binary, uri...) are left as they are."""
from __future__ import annotations

NO_NUL_PATTERN = r"^[^\x00\ud800-\udfff]*$"


def _mark(node) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, list):
            stack.extend(n)
            continue
        if not isinstance(n, dict):
            continue
        if n.get("type") == "string" and not ({"pattern", "enum", "format"} & n.keys()) and not n.get("readOnly"):
            n["pattern"] = NO_NUL_PATTERN
        stack.extend(v for k, v in n.items() if k not in ("example", "examples", "default"))


def strings_refuse_nul(result, generator, request, public):
    _mark(result.get("components", {}).get("schemas", {}))
    for path in result.get("paths", {}).values():
        for op in path.values():
            if isinstance(op, dict):
                _mark(op.get("parameters", []))
                _mark(op.get("requestBody", {}))
    return result


# Request bodies that need at least one of several optional fields (a rule a serializer states in its
# validate(); OpenAPI states it with anyOf), by component name.
AT_LEAST_ONE_OF = {"WeightUpdate": ["path", "checkpoint_id"]}


def at_least_one_of(result, generator, request, public):
    """Each branch of the anyOf is the whole object with one more required field (a bare {"required": [...]}
    beside "properties" is lost on some generators, which then send the field with no constraint)."""
    schemas = result.get("components", {}).get("schemas", {})
    for name, fields in AT_LEAST_ONE_OF.items():
        for component in (name, f"{name}Request"):
            if component not in schemas:
                continue
            whole = schemas[component]
            branch = {k: v for k, v in whole.items() if k not in ("description", "anyOf")}
            schemas[component] = {"description": whole.get("description", ""), "anyOf": [
                {**branch, "required": sorted({*branch.get("required", []), f})} for f in fields]}
            refs = {f"#/components/schemas/{component}"}
            for path in result.get("paths", {}).values():  # a body is needed to name one of them
                for op in path.values():
                    body = op.get("requestBody") if isinstance(op, dict) else None
                    if body and any(c.get("schema", {}).get("$ref") in refs for c in body.get("content", {}).values()):
                        body["required"] = True
    return result


# Response components whose objects may carry only some of their fields (the stream's ?fields=): only these
# are always there.
PARTIAL_RESPONSES = {"StreamRollout": ["id"]}


def partial_responses(result, generator, request, public):
    schemas = result.get("components", {}).get("schemas", {})
    for name, always in PARTIAL_RESPONSES.items():
        if name in schemas:
            schemas[name]["required"] = always
    return result
