from shared.schema import SCHEMA_DIR, schemas


def test_committed_schemas_match_the_structs():
    generated = schemas()
    committed = {p.name: p.read_text() for p in SCHEMA_DIR.glob("*.json")}
    assert committed == generated, "run `python -m shared.schema` and commit docs/schema/"


def test_generate_request_schema_is_strict_and_tagged():
    import json

    schema = json.loads(schemas()["generate_request.json"])
    request = schema["$defs"]["GenerateRequest"]
    assert request["additionalProperties"] is False
    assert request["properties"]["type"] == {"enum": ["generate"]}
    assert request["properties"]["priority"] == {"default": 5, "maximum": 10, "minimum": 0,
                                                 "type": "integer"}
