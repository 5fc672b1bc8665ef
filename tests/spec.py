"""What the tests share from the specification: the reference's fixture folder and the answer
fields of contract.md §3, in their order."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "reference"
ANSWER_FIELDS = {
    "noul": ["noul", "latency_s", "latency_total_s"],
    "choice": [
        "choice",
        "probabilities",
        "abstain",
        "valid",
        "confidence",
        "latency_s",
        "latency_total_s",
    ],
    "score": ["score", "probabilities", "confidence", "latency_s", "latency_total_s"],
}


def rows_as_json(rows) -> list[dict]:
    """Prepared rows (runtime.types.Row) as the fixtures' `rows` lists write them."""
    return [
        {
            "tokens": list(row.tokens),
            "zq": row.zq,
            "u": row.u,
            "targets": [list(target) for target in row.targets],
            "first": row.first,
        }
        for row in rows
    ]
