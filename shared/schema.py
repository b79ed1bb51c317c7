"""JSON Schemas of the public messages, generated from the msgspec structs.

`python -m shared.schema` writes them under docs/schema/; a test fails when they drift.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from shared.protocol import Cancel, Completion, Delta, Error, GenerateRequest

PUBLIC_MESSAGES = {"generate_request": GenerateRequest, "delta": Delta, "completion": Completion,
                   "error": Error, "cancel": Cancel}
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "docs" / "schema"


def schemas() -> dict[str, str]:
    """File name -> schema text."""
    files = {}
    for name, struct in PUBLIC_MESSAGES.items():
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                  **msgspec.json.schema(struct)}
        files[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def main() -> int:
    SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in schemas().items():
        (SCHEMA_DIR / name).write_text(text)
        print(f"wrote {SCHEMA_DIR / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
