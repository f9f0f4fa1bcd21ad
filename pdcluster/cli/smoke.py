"""The client side of a smoke check: one chat question through the router's OpenAI API, and a service's
/metrics read into numbers (`prometheus_client`'s own text parser)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

SMOKE_QUESTION = "What is the capital of France?"
SMOKE_MAX_TOKENS = 64   # room for a whole answer to SMOKE_QUESTION


def smoke_request(url: str, model: str, question: str = SMOKE_QUESTION, max_tokens: int | None = None,
                  timeout: float = 120.0) -> dict[str, Any]:
    """One greedy chat completion through the router at `url`; the response body (raises on failure).
    `max_tokens` None leaves it to the router's default."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """A /metrics page as {'name{label="value",...}': value}, unlabelled samples keyed by the bare name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
