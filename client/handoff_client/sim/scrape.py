"""The server's own counters, read from its Prometheus endpoint."""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    """Samples keyed by name and sorted labels: ``(name, (("result", "success"),))``."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def total(self, name: str) -> float:
        """Summed over every label combination."""
        return sum(v for (sample, _), v in self.samples.items() if sample == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (sample, labels), value in self.samples.items():
            if sample == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out


def parse(text: str) -> ServerMetrics:
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return ServerMetrics(samples)


async def scrape(url: str, timeout_s: float = 5.0) -> ServerMetrics:
    """Fetch and parse ``url``; raises OSError (URLError included) when unreachable."""

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: bytes = response.read()
        return body.decode()

    # urllib blocks; a thread keeps the event loop (and the sidecars) running.
    return parse(await asyncio.to_thread(fetch))
