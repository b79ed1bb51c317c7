"""Float bounds are written as floats everywhere, so the published schemas do not depend on import
order (typing caches `Annotated[float, Meta(gt=0)]` and `...Meta(gt=0.0)` as one type)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOAT_META = re.compile(r"Annotated\[float, msgspec\.Meta\(([^)]*)\)\]")
INT_BOUND = re.compile(r"\b(?:gt|ge|lt|le)=-?\d+(?![\d.eE*])")


def test_no_float_annotation_has_an_integer_bound():
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}"
             for folder in ("shared", "services", "loadtest")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for match in FLOAT_META.finditer(path.read_text())
             if INT_BOUND.search(match.group(1))]
    assert found == []
