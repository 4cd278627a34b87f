"""Schemathesis hooks for `test_openapi.py` (loaded with `SCHEMATHESIS_HOOKS`).

One check replaces Schemathesis's `positive_data_acceptance`, stricter where it can be:
`service/openapi.json` gives the run config (`config`) as an object that kernelbot's rules
validate (its file names, `main` among `sources`, the last benchmark line of a ranked run...),
which no JSON Schema can say, so a schema-valid submission may be refused `422` for its
config alone. The check proves that is the only reason: it sends the same request again with
a valid config, which must then be accepted. Any other schema-valid request refused with a
4xx other than 401, 403, 404, 409 or 429 fails, as in Schemathesis's own check.
"""

from __future__ import annotations

from typing import Any

import requests
import schemathesis
from samples import sample_config

# Schemathesis's default for positive data, less nothing: 2xx, 3xx, these, and 5xx.
ALSO_ACCEPTED = {401, 403, 404, 409, 429}


def _accepted(status: int) -> bool:
    return status < 400 or status >= 500 or status in ALSO_ACCEPTED


@schemathesis.check
def accepted_unless_only_the_run_config_breaks_a_rule(ctx: Any, response: Any, case: Any) -> None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return
    if _accepted(response.status_code):
        return
    op = case.operation
    submission = op.method.upper() == "POST" and op.path == "/v1/submissions"
    if not (submission and response.status_code == 422 and isinstance(case.body, dict)):
        raise AssertionError(
            f"Valid data should have been accepted: {response.status_code} {response.text[:300]}"
        )
    body = {**case.body, "config": sample_config()}
    auth = response.request.headers.get("Authorization")
    again = requests.post(
        response.request.url,
        json=body,
        headers={"Authorization": auth} if auth else {},
        timeout=10,
    )
    if not _accepted(again.status_code):
        raise AssertionError(
            f"Valid data was refused ({response.status_code}), and still with a valid config: "
            f"{again.status_code} {again.text[:300]}"
        )
