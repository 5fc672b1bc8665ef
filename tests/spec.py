"""What the tests share from the specification: the reference's fixture folder (copied into the
repository, tests/fixtures/reference/README.md) and the answer fields of docs/contract.md §3, in
order."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference"
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
