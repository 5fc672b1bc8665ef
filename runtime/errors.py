"""Errors that map to the worker's statuses (docs/contract.md §1.5): 400, 422 and 500."""

from __future__ import annotations


class BodyError(ValueError):
    """The body failed the strict JSON parse or is not an object: 400."""

    status = 400


class ContractError(ValueError):
    """A contract or preparation refusal: 422 with the message as `detail`."""

    status = 422

    def within(self, prefix: str) -> ContractError:
        """The same refusal with context prepended, joined by ': ' as the worker's error chain."""
        return ContractError(f"{prefix}: {self}")


class ExecutionError(RuntimeError):
    """Execution failed (bad head output, bad calibration, engine failure): 500."""

    status = 500
