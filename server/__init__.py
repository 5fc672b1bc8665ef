"""The HTTP worker (`omnijev serve`): FastAPI app, admission and metrics.

Follows the native worker's main.rs (docs/contract.md §1); see server/app.py.
"""
