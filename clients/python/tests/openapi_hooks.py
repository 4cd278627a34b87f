"""Schemathesis hooks for `test_openapi.py` (loaded with `SCHEMATHESIS_HOOKS`).

`service/openapi.json` states every rule of the run config (`config`) that JSON Schema can say,
and Schemathesis runs every check against it, `positive_data_acceptance` included. Two rules
remain that no JSON Schema can say, and the document names them in `RunConfig`'s description:
a `py` config's `main` is one of the keys of `sources`, and no file is given twice (two spellings
of one path, or in `cu` both in `sources` and `headers`). This hook makes every generated
*positive* case keep them too, so that a positive case the service refuses is a defect of the
document or the service, never of the generator: `main` becomes a key of `sources`, and a file
given a second time is dropped. Negative cases are sent as generated.
"""

from __future__ import annotations

from typing import Any

import schemathesis


def _work_path(name: str) -> str:
    """The file a name stands for, as the runner normalizes it (`./a.py` and `a.py` are one)."""
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def _keep_once(files: Any, seen: set[str]) -> Any:
    if not isinstance(files, dict):
        return files
    kept = {}
    for name, text in files.items():
        path = _work_path(name) if isinstance(name, str) else name
        if path in seen:
            continue
        seen.add(path)
        kept[name] = text
    return kept


def _cross_field_rules(config: dict[str, Any]) -> None:
    seen: set[str] = set()
    config["sources"] = _keep_once(config.get("sources"), seen)
    if "headers" in config:
        # Python writes no headers, so only CUDA's may clash with a source.
        config["headers"] = _keep_once(
            config["headers"], seen if config.get("lang") == "cu" else set()
        )
    sources = config.get("sources")
    if config.get("lang") == "py" and isinstance(sources, dict) and sources:
        config["main"] = next(iter(sources))


@schemathesis.hook
def map_case(ctx: Any, case: Any) -> Any:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return case
    op = case.operation
    if op.method.upper() != "POST" or op.path != "/v1/submissions":
        return case
    if isinstance(case.body, dict) and isinstance(case.body.get("config"), dict):
        _cross_field_rules(case.body["config"])
    return case
